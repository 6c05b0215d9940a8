"""gputraced, the capture service: ``server`` (the socket, one thread per connection, the command line), ``protocol``
(frames and the request schema), ``auth`` (who may capture what), ``jobs`` (one capture session per job and the safe
hand-over of its files), ``privileges`` (the capabilities it keeps)."""
