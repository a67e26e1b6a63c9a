"""Verifiable tasks: prompt generation, datasets on disk, rewards, and the SFT warm start."""
