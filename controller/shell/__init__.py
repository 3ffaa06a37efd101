"""The trio services beneath the doors: the core's shell (core_shell.py, main.sock, the
workers' links), the job desk (desk.py, its recovery and the journal's refusals), and what
serves them (durability, the committer, timers, descriptors, the supervisor, metrics);
controller/app.py assembles them with the doors."""
