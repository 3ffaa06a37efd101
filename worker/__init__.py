"""The worker: registers with the controller, pulses, runs one task at a time."""
