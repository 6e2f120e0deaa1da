"""The local Ray cluster a command starts for itself, and its guard."""
