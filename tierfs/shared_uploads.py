"""A step's upload shared by the nodes of a cluster: the port the uploader (`s3tier`) calls and
the cluster (`replication.coordination.upload_plans`) implements, so that neither imports the
other.

A multi-node step's files stay on the nodes that wrote them (and their copies), so no one node
can upload it: each file goes up from one node that holds it (its writer while that lives,
else the first live holder), which marks it stored in the cluster's records; one node (the
committer while it lives) uploads its own share, waits until every other file is marked, and
writes the manifest last, then records that the store holds the version, and every node shows
it persisted. A single node has no plan: it uploads everything itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tierfs import manifest as mf

PERSISTED = "persisted"  # a version's state in the store: its manifest is there
RETIRED = "retired"  # ... --keep-persist removed it from there


class SharesUnavailable(Exception):
    """The cluster's records could not be read or changed now (etcd): the upload is tried
    again later, like one the store failed."""


@dataclass(frozen=True)
class UploadPlan:
    """This node's share of a committed version's upload, from the cluster's records now.

    `mine`: the files this node sends; `stored`: those the store holds already (marked);
    `others`: the files other nodes send, by name -> that node (None: no live node holds it,
    so it cannot go up now); `writes_manifest`: whether this node writes the manifest once
    every file is stored."""

    mine: frozenset[str]
    stored: frozenset[str]
    others: dict[str, str | None] = field(default_factory=dict)
    writes_manifest: bool = False


class SharedUploads(Protocol):
    """The cluster's side of shared uploads (see the module docstring). Each call raises
    `SharesUnavailable` when the records cannot be read or changed now."""

    async def plan(self, manifest: mf.StepManifest) -> UploadPlan | None:
        """This node's share; None when the version is not (or no longer) the cluster's
        committed one."""

    async def mark_stored(self, manifest: mf.StepManifest, names: set[str]) -> None:
        """The store holds these files of the version (their requests succeeded)."""

    async def wait_stored(self, manifest: mf.StepManifest, names: set[str],
                          deadline: float) -> None:
        """Returns once every one of `names` is marked stored, or at `deadline` (trio time)."""

    async def note_store(self, path: str, version: int | None, state: str) -> None:
        """The store's state of the step's `version` (None: the one committed now):
        `persisted` or `retired`, for every node."""
