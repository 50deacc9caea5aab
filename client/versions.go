package client

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// Publish creates the next version of the versioned name (or the shard
// opts.Shard of a version of opts.Shards shards): write it, then Seal
// publishes it. Readers never see a version before all its shards are
// sealed; if this client disconnects before Seal, the whole version is
// aborted. opts.Versioned is set for the caller.
func (c *Client) Publish(ctx context.Context, name string, size int64, opts CreateOptions) (*Object, error) {
	opts.Versioned = true
	return c.Create(ctx, name, size, opts)
}

// GetWith leases a shard of a version of the versioned name: opts.Version
// (0: the latest visible one), or the latest above opts.NewerThan,
// waiting for it as long as ctx allows. A lease on any shard keeps the
// whole version, so the other shards of Lease.Info().Version can be got
// by number meanwhile. On a plain (unversioned) name with zero opts it is
// Get.
func (c *Client) GetWith(ctx context.Context, name string, opts GetOptions) (*Lease, error) {
	return c.getWith(ctx, name, opts, false)
}

// getWith is GetWith; with tensors it sends opts.Tensors (GetBundle), so
// that a daemon that does not hold the bundle may answer with a partial
// replica of just those.
func (c *Client) getWith(ctx context.Context, name string, opts GetOptions, tensors bool) (*Lease, error) {
	if err := checkName("get", name); err != nil {
		return nil, err
	}
	if opts.Shard < 0 {
		return nil, &Error{Op: "get", Name: name, Err: ErrInvalid, Message: fmt.Sprintf("shard %d is negative", opts.Shard)}
	}
	gr := &storev1.GetRequest{Name: name, Version: opts.Version, Shard: uint32(opts.Shard), NewerThan: opts.NewerThan}
	if opts.RequireOwner {
		gr.OwnerUid = &opts.Owner
	}
	if tensors {
		if err := protocol.ValidateTensorNames(opts.Tensors); err != nil {
			var ce *protocol.CodeError
			msg := err.Error()
			if errors.As(err, &ce) {
				msg = strings.TrimPrefix(ce.Message, "get: ")
			}
			return nil, &Error{Op: "get", Name: name, Err: ErrInvalid, Message: msg}
		}
		gr.Tensors = opts.Tensors
	}
	l, err := c.get(ctx, name, gr, opts.Wait || opts.NewerThan != 0)
	if err != nil {
		return nil, err
	}
	if opts.RequireOwner && l.info.OwnerUID != opts.Owner {
		// A daemon older than GetRequest.owner_uid ignores it.
		l.Release()
		return nil, &Error{Op: "get", Name: name, Err: ErrPermission,
			Message: fmt.Sprintf("the object belongs to uid %d, not to uid %d as required", l.info.OwnerUID, opts.Owner)}
	}
	return l, nil
}

// WaitNewer waits until a version of name above than is visible, then
// leases (shard 0 of) the latest one. Subscribers see the same moment as
// an EventSealed carrying the version.
func (c *Client) WaitNewer(ctx context.Context, name string, than uint64) (*Lease, error) {
	return c.GetWith(ctx, name, GetOptions{NewerThan: than, Wait: true})
}

// Version returns the version a versioned Object is a shard of (0 for a
// plain object).
func (o *Object) Version() uint64 { return o.version }

// extend copies the versioned and bundle options into a create request.
func (opts *CreateOptions) extend(cr *storev1.CreateRequest) error {
	if !opts.Versioned && (opts.Version != 0 || opts.Shards > 1 || opts.Shard != 0 || opts.KeepLast != 0) {
		return fmt.Errorf("Version, Shards, Shard and KeepLast need Versioned (use Publish)")
	}
	if opts.Shards < 0 || opts.Shard < 0 || opts.KeepLast < 0 || opts.Shard >= max(opts.Shards, 1) {
		return fmt.Errorf("shard %d of %d shards, keep %d: want 0 <= shard < shards and keep >= 0", opts.Shard, opts.Shards, opts.KeepLast)
	}
	cr.Versioned = opts.Versioned
	cr.Version = opts.Version
	cr.Shards = uint32(opts.Shards)
	cr.Shard = uint32(opts.Shard)
	cr.KeepLast = uint32(opts.KeepLast)
	cr.ManifestSize = uint64(len(opts.Manifest))
	return nil
}
