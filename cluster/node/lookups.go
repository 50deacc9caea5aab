package node

import (
	"context"
	"errors"
	"slices"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/store"
)

// withRecord runs do (as withLookup does) with the record a get of owner's
// name with sel names: version sel.Version, the latest version newer than
// sel.NewerThan, or, for a plain get, the plain object of that name or
// else a versioned name's latest version. Of a version, it is shard
// shard's record. It is the one way a get finds its record.
func (n *Node) withRecord(ctx context.Context, owner uint32, name string, sel store.ClusterGet, shard uint32, do func(cluster.Entry) error) error {
	ref := cluster.Ref{Owner: owner, Name: name}
	switch {
	case sel.Version != 0:
		ref.Version = sel.Version
	case sel.NewerThan != 0:
		l, err := n.latestNewer(ctx, owner, name, sel.NewerThan)
		if err != nil {
			return err
		}
		ref.Version = l.Version
	default:
		if _, versioned := n.mirror.Latest(owner, name); !versioned {
			looked := false
			err := n.withLookup(ctx, ref, func(e cluster.Entry) error {
				looked = true
				return do(e)
			})
			if looked || !errors.Is(err, cluster.ErrNotFound) {
				return err
			}
			// No plain object of that name: a versioned name the mirror
			// has not seen yet, perhaps.
		}
		// A versioned name: its latest version from etcd (the mirror may
		// lag behind a publish that returned on another node), that
		// version's records from the mirror.
		l, err := n.dir.Latest(ctx, owner, name)
		if err != nil {
			return err
		}
		ref.Version = l.Version
	}
	ref.Shard = shard
	return n.withLookup(ctx, ref, do)
}

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
	err = do(e)
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
