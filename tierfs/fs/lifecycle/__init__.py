"""What happens to a step over time, driving the tree: its commit (commits.py, quiet_commits.py,
appends.py), its copies on other tiers (other_tiers.py, step_versions.py, deletes.py), where its
bytes are (fetch_back.py, step_loads.py, eviction.py), its checks (verify.py), start-up
(recovery.py), and the owners of background work (background.py, foreground.py)."""
