"""`omni-mesh bench connector|pipeline|chaos|engines|thinker|autoscale`: the benchmarks, as a user runs them."""

from __future__ import annotations

import argparse
import contextlib
import json

from omni_mesh.cli.common import EXIT_OK, CliError, Command, Declare


def _add_bench(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help="benchmarks: a connector, a running pipeline, real model engines")
    kinds = parser.add_subparsers(dest="bench", metavar="KIND", required=True)
    connector = kinds.add_parser("connector", help="cross-process put->get through one connector vs memcpy and raw")
    connector.add_argument("--connector", default="SharedMemoryConnector", help="connector name")
    connector.add_argument("--config", default="{}", help="the connector's extra: mapping, as JSON")
    connector.add_argument("--sizes", default=None, help="comma-separated sizes (default 4KiB,1MiB,16MiB,256MiB)")
    connector.add_argument("--no-raw", action="store_true", help="skip the raw-library baseline")
    connector.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="where the payload tensor lives (cuda: vs device copy_)"
    )
    connector.add_argument(
        "--start-worker",
        action="store_true",
        help="YuanrongConnector: start a throwaway datasystem worker on loopback for the run (dscli)",
    )
    connector.add_argument(
        "--zero-copy",
        action="store_true",
        help="allocate each payload with connector.empty() (its memory), so the put copies nothing",
    )
    connector.add_argument(
        "--handoff",
        action="store_true",
        help="steady-state hand-offs (put, get, release) of one size (--sizes, default 1MiB) vs memcpy + an "
        "empty round trip measured in the same run",
    )
    connector.add_argument("--handoffs", type=int, default=600, help="--handoff: hand-offs timed (default 600)")
    connector.add_argument("--json", action="store_true", help="print the results as JSON")
    pipeline = kinds.add_parser("pipeline", help="drive a mesh over HTTP with concurrent clients")
    pipeline.add_argument("--url", default=None, help="coordinator URL of a running mesh")
    pipeline.add_argument("--topology", default=None, help="start this topology with `up` for the run instead")
    pipeline.add_argument("--concurrency", type=int, default=32)
    pipeline.add_argument("--duration", type=float, default=10.0, help="seconds of load")
    pipeline.add_argument("--inputs", default='{"prompt": "Hello"}', help="request inputs, as JSON")
    pipeline.add_argument("--params", default="{}", help="request params, as JSON")
    pipeline.add_argument("--timeout-s", type=float, default=30.0)
    pipeline.add_argument(
        "--security", choices=["both", "on", "off"], default=None,
        help="with --topology: measure the control plane with CURVE on, off (OMNI_MESH_INSECURE=1), or both "
        "in alternating rounds, each on a fresh mesh (default: both). --url measures the mesh as it runs",
    )
    pipeline.add_argument("--rounds", type=int, default=3, help="with --topology: rounds per security mode")
    pipeline.add_argument(
        "--coordinators", default=None, metavar="N,M",
        help="with --topology: rounds alternate over these coordinator counts (`up --coordinators N`), e.g. 1,2",
    )
    pipeline.add_argument(
        "--stream", action="store_true",
        help="send stream: true and read the events: time to the first chunk and to the first audio chunk",
    )
    pipeline.add_argument("--json", action="store_true", help="print the results as JSON")
    engines = kinds.add_parser(
        "engines", help="real model parts: the library's one-call generate() vs the same checkpoint as a 3-stage mesh"
    )
    engines.add_argument("--model", default=None, help="a Qwen2.5-Omni checkpoint directory (default: a tiny random one)")
    engines.add_argument(
        "--inputs", default="text",
        help="text: the prompt, generate() vs the mesh; audio, image or video (or several, comma-separated: "
        "text,audio,image,video): the prompt with media, the mesh with and without its encoder stage, new media "
        "vs repeated (the encoder's cache), every kind on the same two meshes",
    )
    engines.add_argument("--prompt", default="Tell me about the weather today.")
    engines.add_argument("--max-tokens", type=int, default=64, help="reply tokens")
    engines.add_argument(
        "--max-audio-tokens", type=int, default=400, help="codec codes (50 per second of audio: 400 is an 8 s reply)"
    )
    engines.add_argument("--rounds", type=int, default=6, help="monolithic requests timed (half before the mesh's, half after)")
    engines.add_argument("--duration", type=float, default=30.0, help="seconds of load per mesh measurement")
    engines.add_argument("--threads", type=int, default=1, help="torch threads per process (monolithic and each stage)")
    engines.add_argument("--device", default="cpu", help="cpu or cuda:N")
    engines.add_argument(
        "--clients", default=None,
        help="comma-separated client counts (e.g. 1,4,16): the mesh with its thinker batching (--max-batch) "
        "against max_batch 1, requests/s and tokens/s at each, time to first audio at the fewest and most",
    )
    engines.add_argument("--max-batch", type=int, default=16, help="the thinker's engine.max_batch with --clients")
    engines.add_argument("--text-only", action="store_true", help="with --clients: modalities [text] (no talker work)")
    engines.add_argument("--json", action="store_true", help="print the results as JSON")
    thinker = kinds.add_parser(
        "thinker", help="the thinker stage alone vs `transformers serve --continuous-batching` on the same weights"
    )
    thinker.add_argument("--model", default=None, help="a Qwen2.5-Omni checkpoint directory (default: a tiny random one)")
    thinker.add_argument("--prompt", default="Tell me about the weather today.")
    thinker.add_argument("--max-tokens", type=int, default=32, help="reply tokens")
    thinker.add_argument("--clients", default="16", help="comma-separated concurrent client counts (e.g. 1,16)")
    thinker.add_argument("--rounds", type=int, default=3, help="alternating rounds per side and client count")
    thinker.add_argument("--duration", type=float, default=10.0, help="seconds of load per round and side")
    thinker.add_argument("--threads", type=int, default=1, help="torch threads per server")
    thinker.add_argument("--device", default="cpu", help="cpu or cuda:N")
    thinker.add_argument("--max-batch", type=int, default=16, help="the thinker stage's engine.max_batch")
    thinker.add_argument(
        "--cb-num-blocks", type=int, default=64,
        help="transformers serve's paged KV cache blocks; the mesh's kv_cache_tokens is blocks x block size",
    )
    thinker.add_argument("--cb-block-size", type=int, default=32, help="tokens per KV cache block")
    thinker.add_argument(
        "--stream-interval", type=int, default=1,
        help="the thinker's engine.stream_interval: tokens per streamed chunk (transformers serve sends each token)",
    )
    thinker.add_argument("--json", action="store_true", help="print the results as JSON")
    chaos = kinds.add_parser(
        "chaos", help="soak: checked load while replicas are SIGKILLed; non-zero exit if an invariant breaks"
    )
    chaos.add_argument(
        "--topology", default=None,
        help="a chain of omni_mesh.bench.chaos_handlers:step stages (default: 3 stages x --replicas, shared memory)",
    )
    chaos.add_argument("--replicas", type=int, default=2, help="replicas per stage of the default topology")
    chaos.add_argument(
        "--edges", choices=["shm", "zmq", "mixed"], default="shm",
        help="connectors of the default topology's two edges: shared memory, ZeroMQ, or one of each",
    )
    chaos.add_argument("--duration", type=float, default=180.0, help="seconds of load and kills")
    chaos.add_argument("--concurrency", type=int, default=8, help="concurrent clients")
    chaos.add_argument("--kill-every", type=float, default=4.0, help="mean seconds between replica SIGKILLs (0: none)")
    chaos.add_argument("--pause-every", type=float, default=20.0,
                       help="mean seconds between coordinator pauses, SIGSTOP then SIGCONT (0: none)")
    chaos.add_argument("--pause-s", type=float, default=2.0, help="how long each pause lasts (< --timeout-s)")
    chaos.add_argument("--stop-every", type=float, default=15.0,
                       help="mean seconds between replica stops, SIGSTOP for --pause-s then SIGCONT (0: none)")
    chaos.add_argument("--drop-every", type=float, default=8.0,
                       help="mean seconds between resets of a replica's TCP connections, with `ss -K` as root (0: none)")
    chaos.add_argument("--tolerate", default="",
                       help="comma-separated fault kinds (pause, drop) whose failures are reported but break nothing")
    chaos.add_argument("--timeout-s", type=float, default=10.0, help="each request's deadline")
    chaos.add_argument("--seed", type=int, default=None, help="seed of the fault schedule (default: random, printed)")
    chaos.add_argument("--json", action="store_true", help="print the results as JSON")
    scale = kinds.add_parser(
        "autoscale", help="a step load (idle, burst, idle) on an autoscaled slow stage under `up`: the timeline"
    )
    scale.add_argument("--min-replicas", type=int, default=1)
    scale.add_argument("--max-replicas", type=int, default=4)
    scale.add_argument("--target-ongoing-requests", type=float, default=2.0, help="in flight plus queued per replica")
    scale.add_argument("--upscale-delay-s", type=float, default=2.0)
    scale.add_argument("--downscale-delay-s", type=float, default=5.0)
    scale.add_argument("--delay-s", type=float, default=0.1, help="the stage's work per request (a wait)")
    scale.add_argument("--concurrency", type=int, default=16, help="closed-loop clients in the burst")
    scale.add_argument("--idle-s", type=float, default=3.0, help="idle seconds before the burst")
    scale.add_argument("--burst-s", type=float, default=20.0, help="seconds of the burst")
    scale.add_argument("--tail-s", type=float, default=60.0, help="the most seconds to wait for the minimum again")
    scale.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser


def _engines_batching(args: argparse.Namespace) -> int:
    """`bench engines --clients 1,4,16`: the batching thinker against max_batch 1 (omni_mesh.bench.engines_batching)."""
    from omni_mesh.bench import engines_batching

    try:
        clients = sorted({int(n) for n in args.clients.split(",")})
    except ValueError:
        raise CliError(f"--clients must be comma-separated counts such as 1,4,16, got {args.clients!r}") from None
    if not clients or clients[0] < 1 or args.max_batch < 2:
        raise CliError(f"--clients must be counts >= 1 and --max-batch >= 2, got {args.clients!r}, {args.max_batch}")
    params = {"temperature": 0, "seed": 0, "max_tokens": args.max_tokens, "max_audio_tokens": args.max_audio_tokens}
    result = engines_batching.run(
        model=args.model, params=params, prompt=args.prompt, threads=args.threads, device=args.device,
        clients=clients, max_batch=args.max_batch, duration_s=args.duration, text_only=args.text_only,
    )
    print(json.dumps(result, indent=2) if args.json else engines_batching.report(result))
    return EXIT_OK


def _cmd_thinker(args: argparse.Namespace) -> int:
    """`bench thinker`: the thinker stage against transformers serve (omni_mesh.bench.thinker_serve)."""
    from omni_mesh.bench import thinker_serve

    clients = _counts(args.clients, "--clients", "clients like 1,16")
    for flag in ("max_tokens", "rounds", "threads", "max_batch", "cb_num_blocks", "cb_block_size",
                 "stream_interval"):
        if getattr(args, flag) < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.duration <= 0:
        raise CliError(f"--duration must be > 0, got {args.duration}")
    try:
        result = thinker_serve.run(
            model=args.model, prompt=args.prompt, max_tokens=args.max_tokens, clients=clients, rounds=args.rounds,
            duration_s=args.duration, threads=args.threads, device=args.device, max_batch=args.max_batch,
            cb_num_blocks=args.cb_num_blocks, cb_block_size=args.cb_block_size, stream_interval=args.stream_interval,
        )
    except (ValueError, RuntimeError) as exc:  # not an Omni checkpoint, ids differ, a server did not come up
        raise CliError(str(exc)) from None
    print(json.dumps(result, indent=2) if args.json else thinker_serve.report(result))
    return EXIT_OK


def _cmd_autoscale(args: argparse.Namespace) -> int:
    from omni_mesh.bench import autoscale

    plan = autoscale.Plan(
        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests, upscale_delay_s=args.upscale_delay_s,
        downscale_delay_s=args.downscale_delay_s, delay_s=args.delay_s, concurrency=args.concurrency,
        idle_s=args.idle_s, burst_s=args.burst_s, tail_s=args.tail_s,
    )
    if plan.concurrency < 1 or plan.burst_s <= 0 or not 0 <= plan.min_replicas <= plan.max_replicas:
        raise CliError("--concurrency >= 1, --burst-s > 0 and 0 <= --min-replicas <= --max-replicas, please")
    try:
        result = autoscale.run(plan)
    except RuntimeError as exc:  # the mesh did not come up
        raise CliError(str(exc)) from None
    print(json.dumps(result, indent=2) if args.json else autoscale.report(result))
    return 1 if result["failed"] else EXIT_OK


def _handoff(args: argparse.Namespace, config: dict, sizes: list[int]) -> int:
    from omni_mesh.bench import handoff

    if len(sizes) != 1 or args.device != "cpu" or args.start_worker or args.handoffs < 1:
        raise CliError("--handoff takes one size (--sizes), on the cpu, without --start-worker; --handoffs >= 1")
    result = handoff.run_handoff(args.connector, config, sizes[0], args.handoffs, zero_copy=args.zero_copy)
    print(json.dumps(result, indent=2) if args.json else handoff.report(result))
    return EXIT_OK


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "autoscale":
        return _cmd_autoscale(args)
    if args.bench == "thinker":
        return _cmd_thinker(args)
    if args.bench == "connector":
        from omni_mesh.bench import connector, connector_report

        config = _json_arg(args.config, "--config")
        if args.device == "cuda" and not connector.torch.cuda.is_available():
            raise CliError("--device cuda: this machine has no CUDA device")
        sizes = connector.parse_sizes(args.sizes)
        if args.handoff:
            return _handoff(args, config, connector.parse_sizes(args.sizes or "1MiB"))
        with contextlib.ExitStack() as stack:
            if args.start_worker:
                if args.connector != "YuanrongConnector":
                    raise CliError("--start-worker starts a datasystem worker: it is for YuanrongConnector")
                from omni_mesh.local_services.datasystem_worker import running_worker

                config = {**config, **stack.enter_context(running_worker()).config}
            result = connector.run(
                args.connector, config, sizes, raw=not args.no_raw, device=args.device, zero_copy=args.zero_copy
            )
        print(json.dumps(result, indent=2) if args.json else connector_report.report(result))
        return EXIT_OK
    if args.bench == "engines":
        from omni_mesh.bench import engines

        for flag in ("max_tokens", "max_audio_tokens", "rounds", "threads"):
            if getattr(args, flag) < 1:
                raise CliError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
        inputs = _kinds(args.inputs)
        if inputs != ["text"]:
            from omni_mesh.bench import engines_media

            result = engines_media.run(
                inputs=inputs, model=args.model, prompt=args.prompt, max_tokens=args.max_tokens,
                max_audio_tokens=args.max_audio_tokens, rounds=args.rounds, threads=args.threads, device=args.device,
            )
            print(json.dumps(result, indent=2) if args.json else engines_media.report(result))
            return EXIT_OK
        if args.clients is not None:
            return _engines_batching(args)
        result = engines.run(
            model=args.model, prompt=args.prompt, max_tokens=args.max_tokens, max_audio_tokens=args.max_audio_tokens,
            rounds=args.rounds, duration_s=args.duration, threads=args.threads, device=args.device,
        )
        print(json.dumps(result, indent=2) if args.json else engines.report(result))
        return EXIT_OK
    if args.bench == "chaos":
        from omni_mesh.bench import chaos

        for flag in ("replicas", "duration", "concurrency", "timeout_s"):
            if not getattr(args, flag) > 0:
                raise CliError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
        for flag in ("kill_every", "pause_every", "stop_every", "drop_every"):
            if not getattr(args, flag) >= 0:
                raise CliError(f"--{flag.replace('_', '-')} must be >= 0 (0: none), got {getattr(args, flag)}")
        try:
            result = chaos.run(
                topology=args.topology, duration_s=args.duration, concurrency=args.concurrency,
                timeout_s=args.timeout_s, kill_every_s=args.kill_every, pause_every_s=args.pause_every,
                pause_s=args.pause_s, drop_every_s=args.drop_every, stop_every_s=args.stop_every,
                tolerate=tuple(kind for kind in args.tolerate.split(",") if kind), seed=args.seed,
                replicas=args.replicas, edges=args.edges,
            )
        except (ValueError, RuntimeError) as exc:  # a bad plan or topology; drops this machine cannot make
            raise CliError(str(exc)) from None
        print(json.dumps(result, indent=2) if args.json else chaos.report(result))
        return 1 if chaos.broken(result) else EXIT_OK  # 1: an invariant broke (the report says which)
    from omni_mesh.bench import pipeline

    if bool(args.url) == bool(args.topology):
        raise CliError("pass exactly one of --url (a running mesh) or --topology (start one for the run)")
    if args.url and args.security:
        raise CliError("--security picks how the bench starts the mesh: it needs --topology, not --url")
    if args.rounds < 1:
        raise CliError(f"--rounds must be >= 1, got {args.rounds}")
    counts = _counts(args.coordinators, "--coordinators", "counts of coordinators like 1,2") if args.coordinators else None
    if counts and args.url:
        raise CliError("--coordinators picks how the bench starts the mesh: it needs --topology, not --url")
    result = pipeline.run(
        url=args.url,
        topology=args.topology,
        concurrency=args.concurrency,
        duration_s=args.duration,
        inputs=_json_arg(args.inputs, "--inputs"),
        params=_json_arg(args.params, "--params"),
        timeout_s=args.timeout_s,
        security=args.security or "both",
        rounds=args.rounds,
        stream=args.stream,
        coordinators=counts,
    )
    print(json.dumps(result, indent=2) if args.json else pipeline.report(result))
    return EXIT_OK


def _counts(text: str, flag: str, what: str) -> list[int]:
    """`flag`'s comma-separated counts, each at least 1 (`what`: the form expected, for the error)."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise CliError(f"{flag}: expected {what}, got {text!r}")
    return counts


def _kinds(text: str) -> list[str]:
    """`bench engines --inputs`: comma-separated kinds, each once, in the order given."""
    from omni_mesh.bench.media_inputs import KINDS

    kinds = [kind.strip() for kind in text.split(",")]
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown or len(set(kinds)) != len(kinds):
        raise CliError(f"--inputs takes kinds from {', '.join(KINDS)}, comma-separated, each once; got {text!r}")
    return kinds


def _json_arg(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{flag}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CliError(f"{flag}: expected a JSON object, got {text!r}")
    return value


COMMANDS: dict[str, tuple[Declare, Command]] = {"bench": (_add_bench, _cmd_bench)}
