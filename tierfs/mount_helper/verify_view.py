"""`tierfs verify` for a person: the report of every copy checked, the one line that ends a
check that found a file with no reachable copy or a bad copy not repaired, and the warnings
for files with fewer than K + 1 copies.

Pure functions over the daemon's verify reply (`tierfs verify --json`'s `steps`): no socket,
so they are tested from a dict. The wording of each copy's line and of lost or short files is
`fs.lifecycle.verify`'s, imported when called: the command line starts without trio.
"""

from __future__ import annotations

from typing import Any

from tierfs.mount_helper.status_view import human_bytes

Step = dict[str, Any]


def failure(steps: list[Step], repair: bool) -> str | None:
    """The one-line error of a check that failed: each file with no reachable copy and its
    last holders, or else the first bad copy not repaired; None when every file has a good
    copy on a tier reached."""
    from tierfs.fs.lifecycle.verify import lost_files

    lost = [lost_files(s["path"], s["lost"]) for s in steps if s.get("lost")]
    if lost:
        return "verify: " + "; ".join(lost)
    failures = [(s, t) for s in steps for t in s["tiers"] if not t["ok"]]
    if not failures:
        return None
    step, tier = failures[0]
    if tier["error"]:
        reason = tier["error"]
    else:
        problems = ([f"{len(tier['bad'])} bad ({', '.join(tier['bad'])})"] if tier["bad"]
                    else []) + ([f"{len(tier['missing'])} missing ("
                                 f"{', '.join(tier['missing'])})"] if tier["missing"] else [])
        reason = " and ".join(problems) + (", no good copy to repair from" if repair else "")
    more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
    return f"verify: {step['path']} on {tier['tier']}: {reason}{more}"


def warnings(steps: list[Step]) -> list[str]:
    """A line for each step with files reachable but at fewer than K + 1 copies."""
    from tierfs.fs.lifecycle.verify import short_files

    return [short_files(step["path"], step["short"], step["wanted"])
            for step in steps if step.get("short")]


def format_verify(steps: list[Step]) -> str:
    """The report: each step, a line per copy checked, then the verdict."""
    from tierfs.fs.lifecycle.verify import TierReport, describe, lost_files

    lines = []
    for step in steps:
        lines.append(f"{step['path']} v{step['version']}: {step['files']} files, "
                     f"{human_bytes(step['bytes'])}")
        for tier in step["tiers"]:
            report = TierReport(**{k: v for k, v in tier.items() if k != "ok"})
            lines.append(f"  {describe(report)}")
        if step.get("lost"):
            lines.append(f"  LOST: {lost_files(step['path'], step['lost'], shown=1000)}")
    copies = sum(len(s["tiers"]) for s in steps)
    repaired = sum(len(t["repaired"]) for s in steps for t in s["tiers"])
    if any(s.get("lost") for s in steps):
        verdict = "FILES WITH NO REACHABLE COPY"
    elif not all(s["ok"] for s in steps):
        verdict = "PROBLEMS FOUND"
    elif any(s.get("short") for s in steps):
        verdict = "every file reachable, some with fewer than K + 1 copies"
    else:
        verdict = "every copy good"
    lines.append(f"{len(steps)} steps, {copies} copies checked: {verdict}"
                 + (f" ({repaired} files repaired)" if repaired else ""))
    return "\n".join(lines)
