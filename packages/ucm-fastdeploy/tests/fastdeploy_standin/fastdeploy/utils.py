"""FastDeploy's loggers, as standard ``logging`` loggers (pytest's caplog sees them)."""

import logging


def get_logger(name, file_name=None):
    return logging.getLogger(f"fastdeploy.{name}")


console_logger = logging.getLogger("fastdeploy.console")
