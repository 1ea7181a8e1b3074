"""Persistent tier: one backend interface (`interface`) with S3 (`s3_backend`, boto3) and
file:// (`backend`) implementations, the uploader that sends committed steps to it and prunes
old ones (`uploader`), the read source that serves their bytes back (`reader`), and the one
retry policy every tier uses (`retry`). It consumes the commit events of `tierfs.fs` and is
the last read source."""
