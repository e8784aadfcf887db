"""The harness's own scripted peers: a fake D, a fake P with its bootstrap server, and an observer
of a real pair. They are built from pdwire's codecs, planning and messages, with their own
sockets, HTTP and transfer engine; never from the reference connector."""
