"""The task feed: keeps a run's task queue stocked, mostly with tasks that still teach."""
