package node

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
)

// Bounds of the node's cache of directory lookups.
const (
	// lookupTTL bounds how long a cached record is used without the
	// watch having said anything: a backstop, since the watch drops the
	// records of deleted names at once.
	lookupTTL = 30 * time.Second
	// maxLookups bounds the cached records; past it the cache starts
	// over.
	maxLookups = 4096
)

// lookups caches the directory's answers (an object's record and its
// holders) for gets of objects this node does not hold, so that a get
// reads etcd only the first time. The watch forgets a name's records
// when the cluster deletes it; a get whose pull fails on a cached answer
// looks the object up again and retries once when the answer changed
// (a replaced incarnation, new holders). Safe for concurrent use.
type lookups struct {
	mu sync.Mutex
	m  map[cluster.Ref]cachedLookup
}

type cachedLookup struct {
	e  cluster.Entry
	at time.Time
}

func (l *lookups) get(ref cluster.Ref) (cluster.Entry, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	c, ok := l.m[ref]
	if !ok || time.Since(c.at) > lookupTTL {
		return cluster.Entry{}, false
	}
	return c.e, true
}

func (l *lookups) put(ref cluster.Ref, e cluster.Entry) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m == nil || len(l.m) >= maxLookups {
		l.m = map[cluster.Ref]cachedLookup{}
	}
	l.m[ref] = cachedLookup{e: e, at: time.Now()}
}

// forgetName drops every cached record of owner's name.
func (l *lookups) forgetName(owner uint32, name string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for ref := range l.m {
		if ref.Owner == owner && ref.Name == name {
			delete(l.m, ref)
		}
	}
}

// lookup is Directory.Lookup through the cache; cached says the answer
// came from it.
func (n *Node) lookup(ctx context.Context, ref cluster.Ref) (e cluster.Entry, cached bool, err error) {
	if e, ok := n.lookups.get(ref); ok {
		return e, true, nil
	}
	e, err = n.dir.Lookup(ctx, ref)
	if err == nil {
		n.lookups.put(ref, e)
	}
	return e, false, err
}

// withLookup runs do with ref's record, from the cache when it has it.
// When do fails on a cached record, the record is read again and, if it
// changed (another incarnation, other holders), do runs once more with
// it.
func (n *Node) withLookup(ctx context.Context, ref cluster.Ref, do func(cluster.Entry) error) error {
	e, cached, err := n.lookup(ctx, ref)
	if err != nil {
		return err
	}
	err = do(e)
	if err == nil || !cached || ctx.Err() != nil {
		return err
	}
	n.lookups.forgetName(ref.Owner, ref.Name)
	fresh, _, lerr := n.lookup(ctx, ref)
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
