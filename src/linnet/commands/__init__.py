"""The `linnet` commands, one module each (`main(argv) -> exit code`), over the library.

Each reads its config or flags, checks everything before writing anything, calls library
functions, and reports; what they share is `linnet.commands.runs`. The library never
imports this package.
"""
