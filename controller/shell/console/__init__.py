"""The operator's console."""
