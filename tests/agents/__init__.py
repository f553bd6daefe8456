"""Tests of the reference agents over real gRPC and HTTP on loopback."""
