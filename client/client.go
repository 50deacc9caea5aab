package client

import (
	"context"
	"errors"
)

var errNotYet = errors.New("client: not implemented yet")

// Client is a connection to the store daemon. Its methods are safe for
// concurrent use.
type Client struct{}

// Dial connects to the daemon at socket ("" means DefaultSocketPath) and
// performs the handshake.
func Dial(ctx context.Context, socket string) (*Client, error) { return nil, errNotYet }

// Close closes the connection.
func (c *Client) Close() error { return nil }

// Server returns what the daemon said about itself in the handshake.
func (c *Client) Server() ServerInfo { return ServerInfo{} }

// Object is an object being written.
type Object struct{}

// Create creates an object.
func (c *Client) Create(ctx context.Context, name string, size int64, opts CreateOptions) (*Object, error) {
	return nil, errNotYet
}

// Bytes returns the writable memory.
func (o *Object) Bytes() []byte { return nil }

// Seal makes the object visible.
func (o *Object) Seal(ctx context.Context) error { return errNotYet }

// Abort discards the object.
func (o *Object) Abort(ctx context.Context) error { return errNotYet }

// Lease is a read-only view of a sealed object.
type Lease struct{}

// Get waits until name is sealed and leases it.
func (c *Client) Get(ctx context.Context, name string) (*Lease, error) { return nil, errNotYet }

// Bytes returns the read-only memory.
func (l *Lease) Bytes() []byte { return nil }

// Info describes the leased object.
func (l *Lease) Info() ObjectInfo { return ObjectInfo{} }

// Release ends the lease.
func (l *Lease) Release() error { return nil }

// Delete removes name.
func (c *Client) Delete(ctx context.Context, name string) error { return errNotYet }

// List lists objects.
func (c *Client) List(ctx context.Context) ([]ObjectInfo, error) { return nil, errNotYet }

// Stat describes name.
func (c *Client) Stat(ctx context.Context, name string) (ObjectInfo, error) {
	return ObjectInfo{}, errNotYet
}

// Subscribe subscribes to events.
func (c *Client) Subscribe(ctx context.Context) (<-chan Event, error) { return nil, errNotYet }
