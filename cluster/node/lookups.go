package node

import (
	"context"
	"errors"
	"slices"

	"github.com/cudaipc/cudaipc/cluster"
)

// lookup is Directory.Lookup answered from the node's mirror of the
// directory (etcddir.Mirror) when it has a record of ref with a live
// holder, from etcd otherwise; mirrored says the answer came from the
// mirror.
func (n *Node) lookup(ctx context.Context, ref cluster.Ref) (e cluster.Entry, mirrored bool, err error) {
	if e, ok := n.mirror.Lookup(ref); ok {
		return e, true, nil
	}
	e, err = n.dir.Lookup(ctx, ref)
	return e, false, err
}

// withLookup runs do with ref's record, from the mirror when it has it.
// When do fails on a mirrored record, the record is read from etcd and,
// if it differs (another incarnation, other holders), do runs once more
// with it: a mirror that lags behind etcd costs a retry, never a wrong
// object (a holder exposes only the incarnation asked for, and every
// chunk is checked against the record's checksums).
func (n *Node) withLookup(ctx context.Context, ref cluster.Ref, do func(cluster.Entry) error) error {
	e, mirrored, err := n.lookup(ctx, ref)
	if err != nil {
		return err
	}
	return n.withEntry(ctx, ref, e, mirrored, do)
}

// withEntry is withLookup with ref's record e looked up already.
func (n *Node) withEntry(ctx context.Context, ref cluster.Ref, e cluster.Entry, mirrored bool, do func(cluster.Entry) error) error {
	err := do(e)
	if err == nil || !mirrored || ctx.Err() != nil {
		return err
	}
	fresh, lerr := n.dir.Lookup(ctx, ref)
	if lerr != nil {
		if errors.Is(lerr, cluster.ErrNotFound) {
			return lerr
		}
		return err
	}
	if fresh.ID == e.ID && fresh.Revision == e.Revision && slices.Equal(fresh.Holders, e.Holders) {
		return err
	}
	return do(fresh)
}
