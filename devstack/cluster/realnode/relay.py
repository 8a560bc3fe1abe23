"""The API server on the node's address: a TCP relay from <node IP>:<port> to the API server on 127.0.0.1:<port>.

The stack's API server listens on loopback only (a free port shared with other stacks' conventions, never exposed);
pods on the real node reach it through the `kubernetes` Service, whose endpoint is the API server's advertised
address, the node's (config.NODE_IP, on the stack's own bridge). TLS passes through untouched: the API server's
certificate names the Service's ClusterIP.

    python -m loom.devstack.cluster.realnode.relay --listen 198.51.100.1:6443 --target 127.0.0.1:6443
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

log = logging.getLogger("loom.stack.relay")


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected host:port, got {text!r}")
    return host, int(port)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: tuple[str, int]) -> None:
    try:
        up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*target), 5)
    except (OSError, TimeoutError) as exc:
        log.warning("dial %s:%s failed: %s", *target, exc)
        writer.close()
        return
    try:
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    finally:
        writer.close()
        up_writer.close()


async def serve(listen: tuple[str, int], target: tuple[str, int]) -> None:
    server = await asyncio.start_server(lambda r, w: _handle(r, w, target), *listen)
    log.info("relaying %s:%s to %s:%s", *listen, *target)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", type=parse_address, required=True)
    parser.add_argument("--target", type=parse_address, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args.listen, args.target))


if __name__ == "__main__":
    main()
