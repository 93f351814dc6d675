"""The wake-word model: its voices, its data and its training (issue 47)."""
