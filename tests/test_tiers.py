"""conftest.py's end-of-run report: the fast-tier tests over FAST_TEST_REPORT_S, by their setup, call and teardown
together; slow-tier tests are never named."""
from collections import Counter
from types import SimpleNamespace

from tests import conftest


def test_the_report_names_the_long_fast_tests_only(monkeypatch):
    monkeypatch.setattr(conftest, "_fast_seconds", Counter())
    bound = conftest.FAST_TEST_REPORT_S
    for nodeid, seconds, keywords in [("t.py::a", bound * 0.6, {}), ("t.py::a", bound * 0.6, {}),
                                      ("t.py::b", bound * 0.9, {}), ("t.py::c", bound * 4, {"slow": 1})]:
        conftest.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds, keywords=keywords))
    lines = []
    conftest.pytest_terminal_summary(SimpleNamespace(section=lines.append, write_line=lines.append))
    assert lines == [f"fast-tier tests over {bound} s (make them quicker or mark them slow)",
                     f"{bound * 1.2:6.1f} s  t.py::a"]
