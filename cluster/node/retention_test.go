package node_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// publishKeep publishes the next version of name on d, one shard of size
// random bytes, with keep_last keep (0: none); it returns the version and
// its bytes.
func (d *daemon) publishKeep(t *testing.T, name string, size, keep int) (uint64, []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	o, err := d.c.Publish(ctx, name, int64(size), client.CreateOptions{Cluster: true, KeepLast: keep})
	if err != nil {
		t.Fatalf("publish %s on %s: %v", name, d.name, err)
	}
	b := make([]byte, size)
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	copy(o.Bytes(), b)
	if err := o.Seal(ctx); err != nil {
		t.Fatalf("seal %s v%d on %s: %v", name, o.Version(), d.name, err)
	}
	return o.Version(), b
}

// holds returns the versions 1..upTo of owner 0's name that d holds.
func (d *daemon) holds(name string, upTo uint64) []uint64 {
	var vs []uint64
	for v := uint64(1); v <= upTo; v++ {
		if d.st.Replicas().Has(0, name, v, 0) {
			vs = append(vs, v)
		}
	}
	return vs
}

// A versioned name published with keep_last K is kept to its newest K
// versions on every node: a commit of V makes B drop its replicas of V-K
// and older, even ones B's own retention would keep (B has not read V
// yet). A replica B has leased stays readable with its bytes until the
// lease ends, no longer advertised as a holder, and then goes.
func TestRetentionClusterWide(t *testing.T) {
	srv := etcdtest.Start(t)
	// The directory keeps every version's records here, so that the
	// holders of retired versions can be seen.
	a := startDaemonKeep(t, srv, "a", 256<<20, "host", 16)
	b := startDaemonKeep(t, srv, "b", 256<<20, "host", 16)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	const name, keep, size = "rl/w", 2, 300000
	sums := map[uint64][]byte{}
	var leased *client.Lease
	defer func() {
		if leased != nil {
			leased.Release()
		}
	}()
	for want := uint64(1); want <= 5; want++ {
		v, data := a.publishKeep(t, name, size, keep)
		if v != want {
			t.Fatalf("published v%d, want v%d", v, want)
		}
		sums[v] = data
		// The commit alone retires B's replicas out of the window,
		// before B reads v.
		testutil.Eventually(t, testutil.Wait, func() error {
			got := b.holds(name, v)
			for _, h := range got {
				if h+keep <= v && h != 3 {
					return fmt.Errorf("after v%d's commit B holds %v", v, got)
				}
			}
			return nil
		})
		l, err := b.c.GetWith(ctx, name, client.GetOptions{Version: v})
		if err != nil {
			t.Fatalf("v%d on B: %v", v, err)
		}
		if !bytes.Equal(l.Bytes(), data) {
			t.Fatalf("v%d on B: bytes differ", v)
		}
		if v == 3 {
			leased = l // B's reader keeps v3
		} else {
			l.Release()
		}
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		if got := b.holds(name, 5); !slices.Equal(got, []uint64{3, 4, 5}) {
			return fmt.Errorf("B holds %v, want [3 4 5] (3 leased)", got)
		}
		if got := a.holds(name, 5); !slices.Equal(got, []uint64{4, 5}) {
			return fmt.Errorf("A holds %v, want [4 5]", got)
		}
		// Nobody advertises v3 any more.
		e, err := b.node.Directory().Lookup(ctx, cluster.Ref{Name: name, Version: 3})
		if err != nil && !errors.Is(err, cluster.ErrNoHolder) || len(e.Holders) != 0 {
			return fmt.Errorf("v3 in the directory: holders %v, %v; want no live holder", e.Holders, err)
		}
		return nil
	})
	if !bytes.Equal(leased.Bytes(), sums[3]) {
		t.Fatal("B's leased v3 changed after it was retired")
	}
	// A new get of a retired version is refused on either node.
	for _, d := range []*daemon{a, b} {
		if _, err := d.c.GetWith(ctx, name, client.GetOptions{Version: 2}); err == nil {
			t.Fatalf("%s: v2 still readable after the commit of v5", d.name)
		}
	}
	leased.Release()
	leased = nil
	testutil.Eventually(t, testutil.Wait, func() error {
		if got := b.holds(name, 5); !slices.Equal(got, []uint64{4, 5}) {
			return fmt.Errorf("B holds %v after its lease on v3 ended, want [4 5]", got)
		}
		return nil
	})
	for v := uint64(4); v <= 5; v++ {
		_, got, err := b.getVersion(ctx, name, client.GetOptions{Version: v})
		if err != nil || !bytes.Equal(got, sums[v]) {
			t.Fatalf("v%d on B at the end: %v", v, err)
		}
		e, err := a.node.Directory().Lookup(ctx, cluster.Ref{Name: name, Version: v})
		if err != nil || !slices.Equal(e.Holders, []string{"a", "b"}) {
			t.Fatalf("v%d holders %v %v, want [a b]", v, e.Holders, err)
		}
	}
}

// A name published without keep_last has records without Keep, as
// records written before it existed: retention stays per node, and B keeps
// the one version it read however many versions are committed after it.
func TestRetentionWithoutKeepIsPerNode(t *testing.T) {
	srv := etcdtest.Start(t)
	a := startDaemonKeep(t, srv, "a", 256<<20, "host", 16)
	b := startDaemonKeep(t, srv, "b", 256<<20, "host", 16)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const name, size = "rl/old", 200000
	v1, s1 := a.publishKeep(t, name, size, 0)
	if _, got, err := b.getVersion(ctx, name, client.GetOptions{Version: v1}); err != nil || !bytes.Equal(got, s1) {
		t.Fatalf("v1 on B: %v", err)
	}
	handled := node.WatchHandled(b.node)
	for range 4 {
		a.publishKeep(t, name, size, 0)
	}
	// B's watch sees the four commits (and nothing else here).
	testutil.Eventually(t, testutil.Wait, func() error {
		if n := node.WatchHandled(b.node) - handled; n < 4 {
			return fmt.Errorf("B's watch handled %d events, want the 4 commits", n)
		}
		return nil
	})
	if got := b.holds(name, 5); !slices.Equal(got, []uint64{v1}) {
		t.Fatalf("B holds %v, want [%d]: per-node retention", got, v1)
	}
	if _, got, err := b.getVersion(ctx, name, client.GetOptions{Version: v1}); err != nil || !bytes.Equal(got, s1) {
		t.Fatalf("v1 on B after 4 newer commits: %v", err)
	}
	e, err := a.node.Directory().Lookup(ctx, cluster.Ref{Name: name, Version: v1})
	if err != nil || !slices.Equal(e.Holders, []string{"b"}) || e.Keep != 0 {
		t.Fatalf("v1's record: keep %d holders %v %v, want no keep, held by b", e.Keep, e.Holders, err)
	}
}
