"""The power-mode hint against a stand-in ``nvpmodel`` (NVIDIA's tool exists only on a Jetson:
this script keeps the mode in a file, logs its calls and prints what the real one prints)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from edged.device.power import IdlePowerMode
from tests.integration.edged.test_idle_unload import NVPMODEL


def tool(tmp_path: Path, mode: int = 0, slow: float = 0.0) -> IdlePowerMode:
    (tmp_path / "mode").write_text(f"{mode}\n")
    script = tmp_path / "nvpmodel"
    text = NVPMODEL.format(log=tmp_path / "calls", mode=tmp_path / "mode")
    script.write_text(text.replace('echo "$*"', f'sleep {slow}; echo "$*"', 1))
    script.chmod(0o755)
    return IdlePowerMode(2, tmp_path / "saved", command=str(script))


def mode(tmp_path: Path) -> int:
    return int((tmp_path / "mode").read_text())


def test_idle_switches_busy_restores_and_a_load_during_the_switch_wins(tmp_path: Path) -> None:
    power = tool(tmp_path, slow=0.2)

    async def scenario() -> None:
        await power.idle(lambda: False)  # a model woke meanwhile: no switch
        assert mode(tmp_path) == 0 and not (tmp_path / "calls").exists()
        # a load starts while the switch is under way: it waits for it, then restores
        switching = asyncio.create_task(power.idle(lambda: True))
        await asyncio.sleep(0.05)
        await power.busy()
        await switching
        assert mode(tmp_path) == 0 and power.before is None
        assert (tmp_path / "calls").read_text().split("\n")[:3] == ["-q", "-m 2", "-m 0"]
        assert not (tmp_path / "saved").exists()

    asyncio.run(scenario())


def test_a_mode_left_switched_by_a_crash_is_restored_at_start(tmp_path: Path) -> None:
    power = tool(tmp_path, mode=0)

    async def scenario() -> None:
        await power.idle(lambda: True)
        assert mode(tmp_path) == 2 and (tmp_path / "saved").read_text() == "0\n"
        again = IdlePowerMode(2, tmp_path / "saved", command=power.command)  # a new edged
        await again.recover()
        assert mode(tmp_path) == 0 and not (tmp_path / "saved").exists()

    asyncio.run(scenario())


def test_without_the_tool_the_hint_turns_itself_off(tmp_path: Path) -> None:
    power = IdlePowerMode(2, tmp_path / "saved", command="no-such-nvpmodel")

    async def scenario() -> None:
        await power.idle(lambda: True)
        assert "not installed" in power.broken and power.before is None
        await power.busy()

    asyncio.run(scenario())
