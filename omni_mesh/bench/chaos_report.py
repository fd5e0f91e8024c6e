"""The invariants of `omni-mesh bench chaos` and its printed report, both read off `chaos.run`'s result."""

from __future__ import annotations

from typing import Any

from omni_mesh.bench.chaos_faults import KINDS, LEGITIMATE_CAUSES

LATE_MARGIN_S = 1.0


def illegitimate_failures(result: dict[str, Any]) -> dict[str, int]:
    """{cause: count} of the failures no fault legitimately explains and the run does not tolerate."""
    allowed = {*LEGITIMATE_CAUSES, *result["tolerate"]}
    return {cause: n for cause, n in result["failed_by_cause"].items() if cause not in allowed}


def broken(result: dict[str, Any]) -> list[str]:
    """The invariants the result breaks (empty: all hold)."""
    problems = []
    if result["wrong"]:
        problems.append(f"{result['wrong']} wrong output(s)")
    if result["late"]:
        problems.append(f"{result['late']} request(s) hung: no answer by the deadline + {LATE_MARGIN_S:g} s")
    if bad := illegitimate_failures(result):
        problems.append("request(s) failed with no fault that legitimately fails them: "
                        + ", ".join(f"{cause}: {n}" for cause, n in sorted(bad.items())))
    if result.get("leftover_processes"):
        problems.append(f"{len(result['leftover_processes'])} mesh process(es) still running after the mesh stopped")
    if result["leftover_segments"]:
        problems.append(f"{len(result['leftover_segments'])} shared-memory segment(s) left in /dev/shm")
    if result["launcher_exit_status"] != 0:
        problems.append(f"omni-mesh up exited with status {result['launcher_exit_status']} on SIGINT")
    return problems


def _plan(result: dict[str, Any]) -> str:
    kinds = []
    if result["kill_every_s"]:
        kinds.append(f"a replica SIGKILL every ~{result['kill_every_s']:g} s")
    if result["pause_every_s"]:
        kinds.append(f"a {result['pause_s']:g} s coordinator pause every ~{result['pause_every_s']:g} s")
    if result.get("stop_every_s"):
        kinds.append(f"a {result['pause_s']:g} s replica SIGSTOP every ~{result['stop_every_s']:g} s")
    if result["drop_every_s"]:
        kinds.append(f"a replica's connections reset every ~{result['drop_every_s']:g} s")
    return ", ".join(kinds) or "no faults"


def report(result: dict[str, Any]) -> str:
    sent = result["sent"]
    failed = sum(result["failed"].values())
    shape = ", ".join(f"{name} x{n}" for name, n in result["replicas"].items())
    by_cause = result["failed_by_cause"]
    lines = [
        f"chaos soak of {result['topology']} ({shape}): {result['concurrency']} clients for "
        f"{result['elapsed_s']:.0f} s, timeout_s {result['timeout_s']:g}, {_plan(result)} (seed {result['seed']})",
        f"  sent               {sent}   ({sent / result['elapsed_s']:.1f} req/s; latency p50 {result['p50_s'] * 1e3:.0f} ms, "
        f"p99 {result['p99_s'] * 1e3:.0f} ms, max {result['max_s']:.2f} s)",
        f"  succeeded          {result['succeeded']}   ({100 * result['succeeded'] / sent if sent else 0:.2f}%)",
        f"  failed             {failed}" + ("   by status: " + ", ".join(
            f"{status}: {n}" for status, n in sorted(result["failed"].items())) if failed else ""),
        "      by cause: legitimate: "
        + (", ".join(f"{c} {by_cause[c]}" for c in LEGITIMATE_CAUSES if c in by_cause) or "none")
        + "; not legitimate: "
        + (", ".join(f"{c} {n}" for c, n in sorted(by_cause.items()) if c not in LEGITIMATE_CAUSES) or "none")
        + (f" (tolerated: {', '.join(result['tolerate'])})" if result["tolerate"] else ""),
    ]
    lines += [f"      {cause}: e.g. {reason}" for cause, reason in sorted(result["failure_examples"].items())]
    lines += [
        f"  wrong outputs      {result['wrong']}",
        *(f"      {example}" for example in result["wrong_examples"]),
        f"  hung (no answer by deadline + {LATE_MARGIN_S:g} s) {result['late']}"
        + (f"   slowest: {', '.join(f'{s:.2f} s' for s in result['late_s'])}" if result["late"] else ""),
        "  faults             " + ", ".join(f"{kind} {result['faults'].get(kind, 0)}" for kind in KINDS)
        + "   (" + ", ".join(f"{target}: {n}" for target, n in sorted(result["faults_by_target"].items())) + ")",
        "      not made: " + (", ".join(f"{why} x{n}" for why, n in sorted(result["faults_skipped"].items())) or "none"),
        f"  leftover segments  {len(result['leftover_segments'])}   ({result['mesh_processes']} mesh processes held up to "
        f"{result['most_segments_held']} at once)",
        *(f"      {name}" for name in result["leftover_segments"][:10]),
        f"  leftover processes {len(result.get('leftover_processes', []))}"
        + (f"   pids: {result['leftover_processes'][:10]}" if result.get("leftover_processes") else ""),
        f"  launcher exit      {result['launcher_exit_status']}",
    ]
    problems = broken(result)
    lines.append("BROKEN: " + "; ".join(problems) if problems else "OK: every invariant holds")
    return "\n".join(lines)
