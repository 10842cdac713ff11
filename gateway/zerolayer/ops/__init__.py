"""Operations: metrics, health endpoints, systemd notify, neuron-monitor, socket tuning, logging.

Each module is self-contained and knows nothing of the server or engine; the server wires them in
at start-up. Nothing here runs on the event loop.
"""

from zerolayer.ops.health import HttpServerHandle, start_http_server
from zerolayer.ops.logging import REQUEST_LOG, setup_logging
from zerolayer.ops.metrics import Metrics
from zerolayer.ops.neuron_monitor import NeuronMonitor, NeuronMonitorExporter, start_neuron_monitor
from zerolayer.ops.notify import Notifier, notify
from zerolayer.ops.sockets import apply_socket_options, make_listen_socket

__all__ = [
    "REQUEST_LOG",
    "HttpServerHandle",
    "Metrics",
    "NeuronMonitor",
    "NeuronMonitorExporter",
    "Notifier",
    "apply_socket_options",
    "make_listen_socket",
    "notify",
    "setup_logging",
    "start_http_server",
    "start_neuron_monitor",
]
