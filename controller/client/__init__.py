"""Clients of the controller: the UDP engine (`UdpSession`) and the `udp-client` command.

`engine.py` speaks the datagram protocol under trio; `cli.py` is the command
line; `output.py` is what it prints on a terminal.
"""

from controller.client.engine import Outcome, UdpSession

__all__ = ["Outcome", "UdpSession"]
