"""Reading xfuse's failure reports out of a launcher's stderr (shared by the fault and multi-node tests)."""

import datetime
import re

REPORT = re.compile(r"\[xfuse (\d\d:\d\d:\d\d\.\d{3})\] (rank (\d+) .*)")


def at(stamp: str, day: datetime.date) -> float:
    """A report's ``HH:MM:SS.mmm`` stamp on ``day`` as a POSIX time."""
    return datetime.datetime.combine(day, datetime.time.fromisoformat(stamp)).timestamp()


def parse_reports(stderr: str, day: datetime.date | None = None) -> dict[int, tuple[float, str]]:
    """{rank: (report time, report text)}: each rank's first report, its headline and indented lines."""
    day = day or datetime.date.today()
    lines, reports = stderr.splitlines(), {}
    for i, line in enumerate(lines):
        match = REPORT.search(line)
        if match and int(match.group(3)) not in reports:
            block = [match.group(2)]
            for follow in lines[i + 1 : i + 8]:  # the report's indented lines, up to its op log
                if not follow.startswith("  "):
                    break
                block.append(follow)
            reports[int(match.group(3))] = (at(match.group(1), day), "\n".join(block))
    return reports
