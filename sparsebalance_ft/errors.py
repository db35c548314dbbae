"""User-fixable errors.

Anything a user can fix by editing a recipe, a data file or a command line raises a subclass
of `UserError` whose message is one line naming the key, file or line at fault. The CLI
prints that line and exits with status 2; everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem in the user's input, reported as one line."""
