"""`linnet prepare`: stream a corpus into a checksummed token cache (linnet.pretrain.prepare).

    linnet prepare --config configs/pretrain-tiny-cpu.yaml
    linnet prepare --config run.yaml --set data.prepare_workers=4
    linnet prepare --verify runs/cache/shakespeare      # re-hash every shard
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

from linnet.commands.spellings import parse_with_config
from linnet.config import PretrainConfig, load, template
from linnet.pretrain import cache as cache_format
from linnet.pretrain.prepare import prepare
from linnet.report.tables import print_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="linnet prepare", description="Tokenize a corpus into a token cache.")
    parser.add_argument("--config", help="YAML config (the data group is read; see `linnet pretrain --template`)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. data.prepare_workers=4 (repeatable)")
    parser.add_argument("--verify", nargs="?", const=True, default=None, metavar="CACHE",
                        help="re-hash every shard of CACHE (default: the config's data.cache) and exit")
    parser.add_argument("--template", action="store_true", help="print every field with its default and help")
    args = parse_with_config(parser, argv)
    if args.template:
        print(template(PretrainConfig))
        return 0
    config: PretrainConfig | None = None
    if args.config is not None or args.set:
        config = load(PretrainConfig, args.config, args.set)
    if args.verify is not None:
        path = args.verify if isinstance(args.verify, str) else (config.data.cache if config else None)
        if not path:
            parser.error("--verify needs a cache path, or --config with data.cache")
        t0 = time.perf_counter()
        cache = cache_format.verify_cache(path)
        files = 1 + sum(len(s.shards) for s in cache.splits.values())
        print(f"{cache.path}: {files} files, every SHA-256 checksum matches "
              f"({time.perf_counter() - t0:.1f}s; fingerprint {cache.fingerprint})")
        return 0
    if config is None:
        parser.error("give --config FILE (and/or --set KEY=VALUE), or --verify CACHE")
    try:
        with warnings.catch_warnings(record=True) as caught:  # printed after the table, where they are seen
            warnings.simplefilter("always")
            result = prepare(config)
    except KeyboardInterrupt:
        print("linnet prepare: interrupted; workers drained, nothing was published", file=sys.stderr)
        return 130
    print_table(result.table())
    for w in caught:
        print(f"linnet prepare: warning: {w.message}", file=sys.stderr)
    return 0
