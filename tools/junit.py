"""pytest's JUnit XML (--junitxml FILE): each test's node id, outcome and printed lines. Standard library only."""

import xml.etree.ElementTree as ET

OUTCOMES = {"failure": "failed", "error": "error", "skipped": "skipped"}  # a testcase's child: its outcome


def read(path):
    """([(node id, outcome, printed lines)] of every testcase in the file, the run's seconds). outcome: passed,
    failed, error or skipped; printed lines: its <system-out>, empty unless pytest ran with -o junit_logging=system-out
    (by default it keeps no output of a test that passed). A run stopped by SIGINT (tools/gpu_session.sh's tier at its
    limit) holds a testcase with no name for the test it cut short: left out. Raises OSError or
    xml.etree.ElementTree.ParseError."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    cases = [(f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}",
              next((word for tag, word in OUTCOMES.items() if case.find(tag) is not None), "passed"),
              "".join(part.text or "" for part in case.findall("system-out")))
             for suite in suites for case in suite.iter("testcase") if case.get("name")]
    return cases, sum(float(suite.get("time", 0)) for suite in suites)
