"""One base class for every error a user can fix (a config key, a file, a checkpoint, a dataset).

The command-line tools catch `UserError` alone and print its message as one line (`cli.run_main`);
anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input or an unusable environment, explained in the message (which names what is at fault)."""
