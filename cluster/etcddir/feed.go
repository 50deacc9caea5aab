package etcddir

import (
	"cmp"
	"context"
	"slices"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/cudaipc/cudaipc/cluster"
)

// Feeders (fan-out, cluster/fanout.go) are nodes pulling an object that
// serve the chunks they have. Each is a cluster.Holder record under
//
//	feed/UID/NAME/VERSION/SHARD/NODE   cluster.Holder  feeder's lease
//
// and their order is the order of the keys' creation revisions: the order
// in which the pulls started, which chains them.

func (k keys) feedRef(r cluster.Ref) string {
	return k.p + "feed/" + refPath(r.Owner, r.Name) + verPath(r.Version, r.Shard) + "/"
}
func (k keys) feed(r cluster.Ref, node string) string { return k.feedRef(r) + node }

// AddFeeder records, on this node's lease, that this node is pulling e's
// incarnation and serves the chunks it has (cluster.Feeds).
func (d *Directory) AddFeeder(ctx context.Context, e cluster.Entry) error {
	ref := e.Ref()
	key := d.k.feed(ref, d.cfg.Node)
	val, err := cluster.Seal(d.cfg.Secret, key, &cluster.Holder{Node: d.cfg.Node, ID: e.ID})
	if err != nil {
		return err
	}
	return d.putOwned(ctx, "feed "+ref.String(), key, val)
}

// RemoveFeeder withdraws this node as a feeder of ref.
func (d *Directory) RemoveFeeder(ctx context.Context, ref cluster.Ref) error {
	return d.deleteOwned(ctx, "stop feeding "+ref.String(), d.k.feed(ref, d.cfg.Node))
}

// Feeders returns the live feeders of ref's incarnation id in the order
// they started. Records that do not verify are logged and left out.
func (d *Directory) Feeders(ctx context.Context, ref cluster.Ref, id string) ([]string, error) {
	what := "feeders of " + ref.String()
	ctx, cancel, err := d.call(ctx, what)
	if err != nil {
		return nil, err
	}
	defer cancel()
	r, err := d.cli.Get(ctx, d.k.feedRef(ref), clientv3.WithPrefix())
	if err != nil {
		return nil, d.fail(ctx, what, err)
	}
	kvs := slices.Clone(r.Kvs)
	slices.SortStableFunc(kvs, func(a, b *mvccpb.KeyValue) int { return cmp.Compare(a.CreateRevision, b.CreateRevision) })
	var out []string
	for _, kv := range kvs {
		var h cluster.Holder
		if err := cluster.Open(d.cfg.Secret, string(kv.Key), kv.Value, &h); err != nil {
			d.log.Warn("ignoring a feeder record", "err", err)
			continue
		}
		if h.ID == id && strings.HasSuffix(string(kv.Key), "/"+h.Node) {
			out = append(out, h.Node)
		}
	}
	return out, nil
}
