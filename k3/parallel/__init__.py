"""Distributed-training building blocks: expert-parallel planning (report §5.2)."""
