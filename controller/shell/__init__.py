"""The trio shells: the only controller code that awaits."""
