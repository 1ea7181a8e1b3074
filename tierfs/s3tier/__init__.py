"""Persistent tier (not built yet): one backend interface with S3 (boto3) and file://
implementations, and the upload scheduler with frequency and retention policies. It will
consume the commit events that `tierfs.fs` sends and serve as the last read source."""
