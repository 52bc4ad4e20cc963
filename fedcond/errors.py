"""The one exception type fedcond raises for problems a user can fix."""


class FedcondError(Exception):
    """A user-fixable problem, stated in one line that names the fix.

    Entry points (the CLI, the ServerApp, the ClientApp) print the message alone, never a traceback.
    """
