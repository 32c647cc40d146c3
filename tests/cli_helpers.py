"""Run the `kiln` command line in-process and capture what it prints."""

import contextlib
import io


def kiln_cli(*argv):
    """(exit code, stdout, stderr) of `kiln ARGV...`."""
    from kiln.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()
