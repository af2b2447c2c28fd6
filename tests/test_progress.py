"""The progress line: its text as a pure function, and ProgressLog's log lines without a terminal."""

from __future__ import annotations

import logging

import pytest

from train_deploy.progress import ProgressLog, duration_text, eta_text


def test_the_eta_line_reads_step_of_total_percent_elapsed_and_time_left():
    assert eta_text(425, 1400, 125) == "step 425/1400 (30%), 2:05 elapsed, ~4:47 left"
    assert eta_text(0, 1400, 3) == "step 0/1400 (0%), 0:03 elapsed, ~? left"
    assert eta_text(1400, 1400, 3725) == "step 1400/1400 (100%), 1:02:05 elapsed, ~0:00 left"
    assert eta_text(3, 12, 30, unit="shard") == "shard 3/12 (25%), 0:30 elapsed, ~1:30 left"


def test_a_resumed_run_counts_its_time_left_from_the_steps_it_made_itself():
    assert eta_text(700, 1400, 60, start=600) == "step 700/1400 (50%), 1:00 elapsed, ~7:00 left"
    assert eta_text(600, 1400, 5, start=600) == "step 600/1400 (42%), 0:05 elapsed, ~? left"


def test_durations_are_minutes_and_seconds_under_an_hour_and_hours_from_one():
    assert [duration_text(s) for s in (0, 59.6, 61, 3599, 3600, 36061)] == [
        "0:00", "1:00", "1:01", "59:59", "1:00:00", "10:01:01"]


def test_a_total_of_zero_is_refused():
    with pytest.raises(ValueError, match=r"^total: 0: must be positive$"):
        eta_text(0, 0, 1)


def test_without_a_terminal_progress_is_logged_and_no_bar_is_drawn(caplog, capsys):
    log = logging.getLogger("test.progress")
    with caplog.at_level(logging.INFO, logger="test.progress"), ProgressLog(4, "encoding", log, unit="shard",
                                                                              every_s=0) as progress:
        for _ in range(4):
            progress.advance()
    lines = [record.getMessage() for record in caplog.records]
    assert [line.split(",")[0] for line in lines] == ["encoding: shard 1/4 (25%)", "encoding: shard 2/4 (50%)",
                                                      "encoding: shard 3/4 (75%)", "encoding: shard 4/4 (100%)"]
    assert lines[-1].endswith("elapsed, ~0:00 left")
    drawn = "".join(capsys.readouterr())
    assert "\r" not in drawn and "shard/s" not in drawn and "%|" not in drawn  # no tqdm bar


def test_on_a_terminal_a_bar_is_drawn(tmp_path):
    import fcntl
    import os
    import select
    import struct
    import subprocess
    import sys
    import termios

    script = ("import logging; from train_deploy.progress import ProgressLog\n"
              "with ProgressLog(3, 'encoding', logging.getLogger('x'), unit='shard', every_s=1e9) as p:\n"
              "    [p.advance() for _ in range(3)]\n")
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    done = subprocess.run([sys.executable, "-c", script], stderr=follower, stdout=subprocess.DEVNULL, timeout=60)
    drawn = ""
    while select.select([leader], [], [], 0.5)[0]:  # read while the terminal is still open: closed, Linux drops it
        drawn += os.read(leader, 65536).decode()
    os.close(follower)
    os.close(leader)
    assert done.returncode == 0 and "\rencoding:   0%|" in drawn and "| 0/3 [00:00<?, ?shard/s]" in drawn
