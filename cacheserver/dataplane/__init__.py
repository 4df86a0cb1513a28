"""The data plane: segment bytes between the cache server and its clients, over shared memory
on one host and a TCP port across hosts, beside gRPC (the control plane).

Both sides: protocol (messages and frames), conn (a socket, TLS on TCP), region (the shared
memory of a session). Server: server (listeners and sessions), server_ops (GET, STREAM, PUT),
stream_server (STREAM's frames out). Client: client (DataTier), client_session (one session's
exchanges), pipeline (requests in flight, replies read in order), checked_recv (a GET's payload
checked as it arrives), stream_client (STREAM's frames in).
"""
