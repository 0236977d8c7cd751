"""The platform query the cache transfer manager makes: not an Iluvatar GPU."""


class _Platform:
    def is_iluvatar(self):
        return False


current_platform = _Platform()
