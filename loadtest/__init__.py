"""Load tests, the mock upstream server and the side-by-side benchmark."""
