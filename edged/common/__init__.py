"""Small helpers that edged and cloudsync both use; they import nothing else of either."""
