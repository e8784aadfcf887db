"""``pdwire node``: run a model-free engine node (a P or a D) in the foreground."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from pdwire.http_models import DEFAULT_BOOTSTRAP_PORT
from pdwire.session import check_lease
from pdwire.sim.geometry import KV_LAYOUT_HELP, KV_LAYOUTS
from pdwire.versions import LEGACY, PDWIRE_2

from .cli_common import add_key_options, read_keys, serve, standalone
from .dp_placement import LOAD_BALANCING, LOOPBACK, DataParallel
from .worker_spec import WORKER_START_HELP, WORKER_STARTS

if TYPE_CHECKING:  # torch, the workers and the server load only when the command runs
    from .node_api import NodeServer


DEFAULT_PORT = 8000


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``node`` subcommand to ``pdwire``'s subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "node",
        help="run a model-free engine node (prefill or decode)",
        description="Run an engine node with vLLM's OpenAI HTTP surface and MooncakeConnector's "
        "kv_transfer_params handling, but no model: its KV is a fixed function of the tokens, "
        "transferred by real workers (one process per TP/PP rank) over Mooncake and ZMQ. "
        "D checks every loaded byte. POST /sleep and POST /wake_up unregister and register "
        "again its KV memory (vLLM's sleep mode). A request whose client goes away while it "
        "waits for free blocks stops waiting, and a D leg then sends P a release-only pull "
        "(10.10.8). Serves until SIGINT or SIGTERM; prints its URL once ready.",
    )
    p.add_argument("--role", choices=("prefill", "decode"))
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port (default 8000)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument(
        "--bootstrap",
        metavar="ADDRESS",
        help="prefill: the bootstrap server every worker registers at, host:port or "
        "http://host:port (vLLM's bootstrap_server_address); without it the node serves one on "
        "--bootstrap-port",
    )
    p.add_argument(
        "--bootstrap-port",
        type=int,
        default=int(os.environ.get("VLLM_MOONCAKE_BOOTSTRAP_PORT", DEFAULT_BOOTSTRAP_PORT)),
        help="prefill: port of the node's own bootstrap server (default "
        f"$VLLM_MOONCAKE_BOOTSTRAP_PORT or {DEFAULT_BOOTSTRAP_PORT})",
    )
    p.add_argument(
        "--bootstrap-host",
        default="0.0.0.0",
        metavar="ADDRESS",
        help="prefill: address of the node's own bootstrap server (default 0.0.0.0, every "
        "address, as spec 4.4-R14 requires)",
    )
    p.add_argument(
        "--register-timeout",
        type=float,
        default=float(os.environ.get("VLLM_MOONCAKE_CONNECTOR_TIMEOUT", 30)),
        metavar="S",
        help="prefill: the bound on each HTTP phase of each registration attempt (4.4-R1); "
        "default $VLLM_MOONCAKE_CONNECTOR_TIMEOUT or 30",
    )
    p.add_argument("--engine-id", default="", help="the engine id (default: a random one)")
    p.add_argument("--profile", choices=(LEGACY, PDWIRE_2), default=PDWIRE_2)
    p.add_argument("--model", default="pdwire-synthetic", help="the served model name")
    geometry = p.add_argument_group("KV geometry (default: Qwen3-8B)")
    geometry.add_argument("--layers", type=int, default=36)
    geometry.add_argument("--kv-heads", type=int, default=8)
    geometry.add_argument("--head-dim", type=int, default=128)
    geometry.add_argument("--block-size", type=int, default=16)
    geometry.add_argument(
        "--kernel-block-size",
        type=int,
        default=None,
        help="tokens per row of each KV region, a divisor of --block-size (default: the block "
        "size); a pull's block id b then stands for rows b*q ... b*q+q-1 (spec 10.6.6)",
    )
    geometry.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="tokens of a sliding window over the odd layers, which then form a second KV-cache "
        "group with block ids of their own; a transfer carries only the last "
        "ceil(window / block size) + 1 of the prompt's blocks of that group (spec 10.4.7)",
    )
    geometry.add_argument(
        "--mamba",
        action="store_true",
        help="the odd layers are state-space (Mamba) layers, a second KV-cache group: a "
        "request keeps its state in one block there, and its list in a transfer puts null "
        "blocks (id 0, never allocated) before it (spec 10.6.3)",
    )
    geometry.add_argument("--kv-layout", choices=KV_LAYOUTS, default="apart", help=KV_LAYOUT_HELP)
    geometry.add_argument(
        "--packed-rows",
        action="store_true",
        help="lay each worker's pool out as one row per block holding every layer's K and V, "
        "its regions views into that row (row offsets, spec 3.2-R10), as a packed MLA cache is",
    )
    geometry.add_argument(
        "--opaque-rows",
        action="store_true",
        help="packed rows (as --packed-rows) registered whole: one region a worker, named after "
        "its first layer; with --sliding-window or --mamba both KV-cache groups share it (group "
        "-1), and a transfer takes both groups' blocks together (spec 10.2.8, 10.6.7)",
    )
    geometry.add_argument("--num-blocks", type=int, default=512, help="blocks per worker pool")
    geometry.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    geometry.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--load-failure-policy", choices=("fail", "recompute"), default="fail")
    p.add_argument(
        "--load-timeout", type=float, default=120.0, help="decode: seconds to wait for P's KV"
    )
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        help="refuse chat completions (HTTP 400), as vLLM does for a model whose tokenizer has "
        "no chat template",
    )
    p.add_argument(
        "--no-verify-kv",
        action="store_true",
        help="decode: decode from whatever bytes P wrote, as an engine with a real model does, "
        "instead of failing a load whose bytes are not the prompt's KV",
    )
    p.add_argument(
        "--abort-timeout",
        type=float,
        default=float(os.environ.get("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", 480)),
        metavar="S",
        help="P's ready wait and block retention, D's receive timeout less 60 s (§6); default "
        "$VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT or 480",
    )
    p.add_argument(
        "--kv-lease-duration",
        type=float,
        metavar="S",
        help="vLLM 0.34's KV lease (§6.4): P holds a finished transfer S seconds and accepts "
        "renewals; D renews every S/6 while a request waits (default: no lease)",
    )
    p.add_argument(
        "--receive-timeout",
        type=float,
        metavar="S",
        help="decode: the receive timeout of each pull (default: --abort-timeout + 60)",
    )
    p.add_argument(
        "--agent",
        metavar="MODULE:CALLABLE",
        default="",
        help="the workers' side-channel agent: a factory taking a "
        "reference_connector.worker_agents.WorkerContext (default: pdwire's own agents)",
    )
    p.add_argument(
        "--worker-start",
        choices=WORKER_STARTS,
        default="spawn",
        help=WORKER_START_HELP,
    )
    add_key_options(
        p,
        "sign and check every side-channel message and sign registrations with the key in "
        "PATH (§8.6; pdwire/2 only); the node's own bootstrap server then requires it too",
    )
    p.add_argument(
        "--prefill-delay",
        type=float,
        default=0.0,
        metavar="S",
        help="prefill: pretend each remote prefill computes for S seconds before its KV is "
        "ready (fault injection: a slow P)",
    )
    dp = p.add_argument_group(
        "data parallelism (prefill, without --bootstrap): which engine serves the bootstrap "
        "server, where the workers register and with which dp_rank (spec 4.4-R13, R15, R16)"
    )
    dp.add_argument("--dp-index", type=int, default=0, help="the engine's DP index (default 0)")
    dp.add_argument(
        "--dp-local-rank", type=int, default=0, help="its DP rank on its node (default 0)"
    )
    dp.add_argument(
        "--dp-load-balancing",
        choices=LOAD_BALANCING,
        default="internal",
        help="hybrid or external: engines local only (each node serves its own bootstrap "
        "server); default internal",
    )
    dp.add_argument(
        "--dp-master-ip",
        default=LOOPBACK,
        metavar="ADDRESS",
        help="vLLM's data_parallel_master_ip (default 127.0.0.1)",
    )
    dp.add_argument(
        "--master-addr",
        default=LOOPBACK,
        metavar="ADDRESS",
        help="vLLM's master_addr, used when one DP rank spans several nodes (default 127.0.0.1)",
    )
    dp.add_argument(
        "--dp-nodes", type=int, default=1, help="how many nodes one DP rank spans (default 1)"
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; 0 on a clean stop, 1 if the node failed, 2 on bad usage."""
    from pdwire.roles import Role

    from .kv_content import KVShape
    from .node import NodeConfig, Policy
    from .node_api import NodeServer
    from .node_worker import WorkerError

    if args.role is None:
        print("pdwire node: --role is required", file=sys.stderr)
        return 2
    role: Role = "prefill" if args.role == "prefill" else "decode"
    policy: Policy = "recompute" if args.load_failure_policy == "recompute" else "fail"
    try:
        key, accepted = read_keys(args)
    except (OSError, ValueError) as exc:
        print(f"pdwire node: {exc}", file=sys.stderr)
        return 2
    try:
        check_lease(args.kv_lease_duration)
        shape = KVShape(
            num_layers=args.layers,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            block_size=args.block_size,
            dtype=args.dtype,
            vocab=args.vocab,
            num_blocks=args.num_blocks,
            kernel_block_size=args.kernel_block_size,
            sliding_window=args.sliding_window,
            mamba=args.mamba,
            packed_rows=args.packed_rows,
            opaque_rows=args.opaque_rows,
            kv_layout=args.kv_layout,
        )
    except ValueError as exc:
        print(f"pdwire node: {exc}", file=sys.stderr)
        return 2
    if key is not None and args.profile == LEGACY:
        print("pdwire node: the legacy profile cannot carry auth_tag (§8.6)", file=sys.stderr)
        return 2
    if args.bootstrap:  # checked before the node's modules load: a bad address fails at once
        from . import bootstrap_client

        try:
            args.bootstrap = bootstrap_client.external_url(args.bootstrap)
        except ValueError as exc:
            print(f"pdwire node: {exc}", file=sys.stderr)
            return 2

    def start() -> NodeServer:
        config = NodeConfig(
            role=role,
            shape=shape,
            tp_size=args.tp,
            pp_size=args.pp,
            host=args.host,
            bootstrap_url=args.bootstrap,
            bootstrap_port=args.bootstrap_port,
            bootstrap_host=args.bootstrap_host,
            register_timeout=args.register_timeout,
            engine_id=args.engine_id,
            profile=LEGACY if args.profile == LEGACY else PDWIRE_2,
            load_failure_policy=policy,
            model=args.model,
            load_timeout=args.load_timeout,
            agent=args.agent,
            worker_start=args.worker_start,
            abort_timeout=args.abort_timeout,
            receive_timeout=args.receive_timeout,
            kv_lease_duration=args.kv_lease_duration,
            verify_kv=not args.no_verify_kv,
            chat_template=not args.no_chat_template,
            prefill_delay=args.prefill_delay,
            auth_key=key,
            accepted_keys=accepted,
            dp=DataParallel(
                index=args.dp_index,
                local_rank=args.dp_local_rank,
                load_balancing=args.dp_load_balancing,
                master_ip=args.dp_master_ip,
                master_addr=args.master_addr,
                nodes=args.dp_nodes,
            ),
        )
        return NodeServer(config).start(port=args.port)

    def banner(server: NodeServer) -> str:
        engine = server.engine
        extra = f", bootstrap {engine.bootstrap_url}" if server.config.role == "prefill" else ""
        return f"{server.config.role} node {engine.engine_id} at {server.url}{extra}"

    return serve("node", start, banner, (RuntimeError, TimeoutError, WorkerError))


def main(argv: list[str] | None = None) -> int:
    return standalone("node", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
