package node

import (
	"context"
	"slices"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/store"
)

// maxVouchLookups bounds the objects MayEvict looks up in etcd (those the
// mirror cannot answer for) for one create: the rest stay.
const maxVouchLookups = 64

// MayEvict implements store.ClusterHook: an object this node holds may be
// evicted when another node holds the same incarnation, as the directory
// says now: its holder records live on their nodes' leases, so a holder
// counts until its lease runs out (the directory's TTL after its death).
// The mirror answers while it is in sync; an object it does not have (a
// large record, or the mirror out of sync) is read from etcd, up to
// maxVouchLookups of them. An object neither can vouch for stays.
func (n *Node) MayEvict(ctx context.Context, objs []store.ClusterObject) []bool {
	self := n.cfg.Directory.Node
	elsewhere := func(e cluster.Entry, id string) bool {
		return e.ID == id && slices.ContainsFunc(e.Holders, func(h string) bool { return h != self })
	}
	ok := make([]bool, len(objs))
	lookups := 0
	for i, co := range objs {
		if co.ID == "" {
			continue
		}
		ref := cluster.Ref{Owner: co.Owner, Name: co.Name, Version: co.Version, Shard: co.Shard}
		if e, hit := n.mirror.Lookup(ref); hit {
			ok[i] = elsewhere(e, co.ID)
			continue
		}
		if lookups >= maxVouchLookups || ctx.Err() != nil {
			continue
		}
		lookups++
		if e, err := n.dir.Lookup(ctx, ref); err == nil {
			ok[i] = elsewhere(e, co.ID)
		}
	}
	return ok
}
