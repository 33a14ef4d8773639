"""``python -m pipeline.serve ARTIFACT_DIR [--host 127.0.0.1 --port 8000 --api-key KEY --max-queue N
--request-timeout S --model-name NAME --prefill-chunk N]``: serve a built artifact over the OpenAI API."""

import argparse
import logging
import sys
from pathlib import Path


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline.serve", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument("artifact", help="a version directory of a build (model.pte, manifest.json, tokenizer/)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1/*")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests that may wait for a sequence; beyond it: 503 with Retry-After (default 64)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds from arrival after which a request ends with an error (default: none)")
    parser.add_argument("--model-name", default=None,
                        help="the model id clients name (default: <experiment>/<version> from the artifact's path)")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="prompt tokens a step takes while other sequences decode (default: all the step width "
                             "they leave); smaller keeps running streams faster and a new prompt's first token later")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--verbose", action="store_true", help="show the libraries' known noise while loading (pipeline/quiet.py)")
    args = parser.parse_args(argv)
    if args.max_queue < 0:
        parser.error(f"--max-queue={args.max_queue} must be >= 0")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        parser.error(f"--prefill-chunk={args.prefill_chunk} must be >= 1")
    if args.request_timeout is not None and not args.request_timeout > 0:
        parser.error(f"--request-timeout={args.request_timeout} must be a positive number of seconds")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    artifact = Path(args.artifact)
    if not (artifact / "manifest.json").is_file():
        print(f"error: {artifact} is not a built artifact (no manifest.json); build one with python -m pipeline", file=sys.stderr)
        return 2
    from pipeline.errors import SessionError
    from pipeline.quiet import filtered_stderr

    try:
        with filtered_stderr(not args.verbose):
            from pipeline.serve.server import build

            app, engine = build(artifact, args.model_name, args.api_key, args.max_queue, args.request_timeout,
                                args.prefill_chunk)
    except SessionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import uvicorn

    engine.start()
    logging.getLogger("pipeline.serve").info("serving %s as %r on http://%s:%d", artifact, app.state.model_name,
                                             args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
