"""The exit statuses of the client's commands, udp-client and jobctl alike.

0 success; 1 a job failed (an error or failed_post) or the controller refused; 2 a usage
error; 3 no answer in time (or, for jobctl, the controller unreachable). A command on many
jobs exits with the highest status among them.
"""

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 3
