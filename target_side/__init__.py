"""The target half of paddock: the server that fences and runs turns."""
