"""``python -m pipeline.serve ARTIFACT_DIR [--host 127.0.0.1 --port 8000 --api-key KEY --max-queue N
--request-timeout S --model-name NAME --prefill-chunk N --engine-restarts N --no-prefix-cache]``: serve a built artifact over the OpenAI API.

Exit status: 0 stopped (SIGINT / SIGTERM); 2 refused before serving (bad flags, not an artifact, no
tokenizer); 3 could not listen (uvicorn's); 4 the engine process died and its ``--engine-restarts``
were spent (a supervisor starts the server afresh)."""

import argparse
import logging
import sys
from pathlib import Path

EXIT_REFUSED, EXIT_NO_LISTEN, EXIT_ENGINE_LOST = 2, 3, 4
# prompt tokens a step takes while others decode: with SmolLM2 at 8 clients of 770-token prompts, 32 kept
# the streams' inter-token p95 within 2x llama-server's (the whole width left: 3.4x) at 1.43x its tokens/s
# and 0.6x its time to first token (docs/benchmarks.md, "serve")
DEFAULT_PREFILL_CHUNK = 32


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline.serve", description=__doc__.split(":", 1)[1].split("\n\n")[0].strip())
    parser.add_argument("artifact", help="a version directory of a build (model.pte, manifest.json, tokenizer/)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1/*")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests that may wait for a sequence; beyond it: 503 with Retry-After (default 64)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds from arrival after which a request ends with an error (default: none)")
    parser.add_argument("--model-name", default=None,
                        help="the model id clients name (default: the checkpoint's name, e.g. SmolLM2-135M-Instruct from "
                             "its GGUF file, else the build's experiment_name)")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                        help="prompt tokens a step takes while other sequences decode, within the step width they "
                             f"leave (default {DEFAULT_PREFILL_CHUNK}; 0: all of it); smaller keeps running streams faster "
                             "and a new prompt's first token later (docs/benchmarks.md, 'serve')")
    parser.add_argument("--engine-restarts", type=int, default=3,
                        help="times a dead engine process is replaced (the artifact loaded again) in the server's life; "
                             f"then the server exits with {EXIT_ENGINE_LOST} for its supervisor to restart it (default 3)")
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                        help="free a finished request's KV rows at once instead of keeping them for prompts that start "
                             "with the same tokens (default: kept, and such prompts prefill only what is new)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--verbose", action="store_true", help="show the libraries' known noise while loading (pipeline/quiet.py)")
    args = parser.parse_args(argv)
    if args.max_queue < 0:
        parser.error(f"--max-queue={args.max_queue} must be >= 0")
    if args.prefill_chunk < 0:
        parser.error(f"--prefill-chunk={args.prefill_chunk} must be >= 1, or 0 for the whole width the decodes leave")
    args.prefill_chunk = args.prefill_chunk or None
    if args.engine_restarts < 0:
        parser.error(f"--engine-restarts={args.engine_restarts} must be >= 0")
    if args.request_timeout is not None and not args.request_timeout > 0:
        parser.error(f"--request-timeout={args.request_timeout} must be a positive number of seconds")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    artifact = Path(args.artifact)
    if not (artifact / "manifest.json").is_file():
        print(f"error: {artifact} is not a built artifact (no manifest.json); build one with python -m pipeline", file=sys.stderr)
        return EXIT_REFUSED
    from pipeline.errors import SessionError
    from pipeline.quiet import filtered_stderr

    try:
        with filtered_stderr(not args.verbose):
            from pipeline.serve.server import build

            app, engine = build(artifact, args.model_name, args.api_key, args.max_queue, args.request_timeout,
                                args.prefill_chunk, args.engine_restarts, args.prefix_cache)
    except SessionError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_REFUSED
    import uvicorn

    # open connections get a few seconds to end when the server stops (a stream of a dead engine has ended)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                                           timeout_graceful_shutdown=5))
    lost: list[str] = []

    def give_up(reason: str) -> None:  # from the engine's reader thread: uvicorn's loop polls should_exit
        lost.append(reason)
        server.should_exit = True

    engine.on_exhausted = give_up
    engine.start()
    logging.getLogger("pipeline.serve").info("serving %s as %r on http://%s:%d", artifact, app.state.model_name,
                                             args.host, args.port)
    try:
        server.run()
    finally:
        engine.stop()
    if lost:
        print(f"error: {lost[0]}", file=sys.stderr)
        return EXIT_ENGINE_LOST
    return 0 if server.started else EXIT_NO_LISTEN


if __name__ == "__main__":
    sys.exit(main())
