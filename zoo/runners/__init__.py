"""Runners: the drive loops that work through queued jobs (in processes, or as Ray tasks)."""
