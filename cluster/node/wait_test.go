package node_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/store"
)

// waitCase is one kind of get that waits on node B for a name that node A
// creates later.
type waitCase struct {
	kind string
	// before runs before B's get starts (a version the get must be newer
	// than); nil for none.
	before func(ctx context.Context, a *daemon, name string) error
	// create makes the name on A and returns what B must read.
	create func(ctx context.Context, a *daemon, name string) (want []byte, ver uint64, err error)
	// get reads the name on B, waiting as long as ctx allows.
	get func(ctx context.Context, b *daemon, name string) (got []byte, ver uint64, err error)
}

// publishOne publishes a one-shard version of name on d (version ver, 0
// for the next), of random bytes drawn from seed, and returns the bytes
// and the version.
func publishOne(ctx context.Context, d *daemon, name string, ver uint64, size int, seed byte) ([]byte, uint64, error) {
	o, err := d.c.Publish(ctx, name, int64(size), client.CreateOptions{Cluster: true, Version: ver})
	if err != nil {
		return nil, 0, err
	}
	want := randomBytes(size, seed)
	copy(o.Bytes(), want)
	if err := o.Seal(ctx); err != nil {
		return nil, 0, err
	}
	return want, o.Version(), nil
}

var waitTensors = []bundle.Spec{
	{Name: "embed", DType: bundle.F32, Shape: []int64{300, 70}},
	{Name: "head", DType: bundle.U8, Shape: []int64{70000}},
}

func waitCases(t *testing.T) []waitCase {
	tensors := tensorsOf(t, 9, waitTensors...)
	getVersion := func(opts client.GetOptions) func(context.Context, *daemon, string) ([]byte, uint64, error) {
		return func(ctx context.Context, b *daemon, name string) ([]byte, uint64, error) {
			ver, got, err := b.getVersion(ctx, name, opts)
			return got, ver, err
		}
	}
	putBundle := func(ctx context.Context, a *daemon, name string) ([]byte, uint64, error) {
		_, err := a.c.PutBundle(ctx, name, tensors, nil, client.CreateOptions{Cluster: true})
		return nil, 0, err
	}
	getBundle := func(names ...string) func(context.Context, *daemon, string) ([]byte, uint64, error) {
		return func(ctx context.Context, b *daemon, name string) ([]byte, uint64, error) {
			l, m, err := b.c.GetBundle(ctx, name, client.GetOptions{Wait: true, Tensors: names})
			if err != nil {
				return nil, 0, err
			}
			defer l.Release()
			if len(names) == 0 {
				names = tensorNames(tensors)
			}
			checkTensors(t, "B's bundle", l.Bytes(), m, tensors, names...)
			return nil, 0, nil
		}
	}
	return []waitCase{
		{kind: "object",
			create: func(ctx context.Context, a *daemon, name string) ([]byte, uint64, error) {
				want := randomBytes(70001, 5)
				o, err := a.c.Create(ctx, name, int64(len(want)), client.CreateOptions{Cluster: true})
				if err != nil {
					return nil, 0, err
				}
				copy(o.Bytes(), want)
				return want, 0, o.Seal(ctx)
			},
			get: getVersion(client.GetOptions{Wait: true})},
		{kind: "latest",
			create: func(ctx context.Context, a *daemon, name string) ([]byte, uint64, error) {
				return publishOne(ctx, a, name, 0, 50003, 6)
			},
			get: getVersion(client.GetOptions{Wait: true})},
		{kind: "version",
			create: func(ctx context.Context, a *daemon, name string) ([]byte, uint64, error) {
				return publishOne(ctx, a, name, 3, 50007, 7)
			},
			get: getVersion(client.GetOptions{Version: 3, Wait: true})},
		{kind: "newer_than",
			before: func(ctx context.Context, a *daemon, name string) error {
				_, _, err := publishOne(ctx, a, name, 0, 40000, 8)
				return err
			},
			create: func(ctx context.Context, a *daemon, name string) ([]byte, uint64, error) {
				return publishOne(ctx, a, name, 0, 50011, 9)
			},
			get: getVersion(client.GetOptions{NewerThan: 1, Wait: true})},
		{kind: "bundle", create: putBundle, get: getBundle()},
		{kind: "tensors", create: putBundle, get: getBundle("head")},
	}
}

// waitingGets waits until d's node has n gets waiting for the directory.
func waitingGets(t *testing.T, d *daemon, n int64) {
	t.Helper()
	testutil.Eventually(t, testutil.Wait, func() error {
		if got := node.WaitingGets(d.node); got != n {
			return fmt.Errorf("%s: %d gets waiting on the directory, want %d", d.name, got, n)
		}
		return nil
	})
}

// clusterPutWorks waits until a cluster-visible put on d is published
// (etcd answers d again after an outage).
func clusterPutWorks(t *testing.T, d *daemon) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	testutil.Eventually(t, 30*time.Second, func() error {
		o, err := d.c.Create(ctx, "probe", 100, client.CreateOptions{Cluster: true})
		if err != nil {
			return err
		}
		copy(o.Bytes(), randomBytes(100, 1))
		if err := o.Seal(ctx); err != nil {
			return err
		}
		return d.c.Delete(ctx, "probe")
	})
}

// A get waiting on node B for a name no node holds wakes when node A
// creates it, and reads it, for every kind of get that waits; with an
// etcd outage (etcd killed and restarted on the same data) between the
// start of B's get and A's create, too. Each get may wait 20 s; the time
// from A's create to B's answer is logged.
func TestWaitingGetWokenByAnotherNode(t *testing.T) {
	for _, outage := range []bool{false, true} {
		mode := "quiet"
		if outage {
			mode = "etcd-restart"
		}
		t.Run(mode, func(t *testing.T) {
			srv := etcdtest.Start(t)
			a, b := startDaemon(t, srv, "a"), startDaemon(t, srv, "b")
			for _, wc := range waitCases(t) {
				t.Run(wc.kind, func(t *testing.T) {
					waitWoken(t, srv, a, b, wc, outage)
				})
			}
		})
	}
}

func waitWoken(t *testing.T, srv *etcdtest.Server, a, b *daemon, wc waitCase, outage bool) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	name := "late-" + wc.kind
	if wc.before != nil {
		if err := wc.before(ctx, a, name); err != nil {
			t.Fatal(err)
		}
	}
	type result struct {
		got []byte
		ver uint64
		err error
		at  time.Time
	}
	res := make(chan result, 1)
	const timeout = 20 * time.Second
	start := time.Now()
	go func() {
		gctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		got, ver, err := wc.get(gctx, b, name)
		res <- result{got, ver, err, time.Now()}
	}()
	waitingGets(t, b, 1)
	if outage {
		srv.Kill()
		testutil.Eventually(t, testutil.Wait, func() error {
			if b.node.Mirror().Synced() {
				return errors.New("B's mirror still in sync with etcd killed")
			}
			return nil
		})
		// Down longer than a directory call's fail-fast window.
		time.Sleep(3 * time.Second)
		select {
		case r := <-res:
			t.Fatalf("B's get answered during the outage: %v", r.err)
		default:
		}
		srv.Restart()
	}
	if outage {
		// A puts once etcd answers it again (a version whose publish
		// failed stays on A, unpublished: its number is taken).
		clusterPutWorks(t, a)
	}
	var want []byte
	var ver uint64
	var created time.Time
	testutil.Eventually(t, 30*time.Second, func() error {
		var err error
		want, ver, err = wc.create(ctx, a, name)
		created = time.Now()
		if err != nil {
			t.Logf("A's create of %s: %v", name, err)
		}
		return err
	})
	select {
	case r := <-res:
		if r.err != nil {
			t.Fatalf("B's get, %v after A created %s: %v", r.at.Sub(created), name, r.err)
		}
		if want != nil && !bytes.Equal(r.got, want) {
			t.Fatalf("B read %d bytes, not A's %d", len(r.got), len(want))
		}
		if r.ver != ver {
			t.Fatalf("B read version %d, A published %d", r.ver, ver)
		}
		wake := r.at.Sub(created)
		t.Logf("%s: B's get answered %v after A's create returned (%v after the get started, its timeout %v)",
			name, wake.Round(time.Millisecond), r.at.Sub(start).Round(time.Millisecond), timeout)
		if wake > timeout/2 {
			t.Errorf("B's get took %v after A's create, most of its %v", wake, timeout)
		}
	case <-ctx.Done():
		t.Fatal("B's get never answered")
	}
	waitingGets(t, b, 0)
}

// During an etcd outage a get that does not wait fails fast with
// cluster.ErrUnavailable (the node's Fetch; the client's ErrUnavailable); local gets and puts go on; a get that starts waiting
// during the outage waits for the directory to come back and reads the
// name node A then creates.
func TestGetsDuringEtcdOutage(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := startDaemon(t, srv, "a"), startDaemon(t, srv, "b")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	remote := a.put(t, "remote", 30000, client.CreateOptions{Cluster: true})
	kept := b.put(t, "kept", 5000, client.CreateOptions{})
	srv.Kill()
	testutil.Eventually(t, testutil.Wait, func() error {
		if b.node.Mirror().Synced() {
			return errors.New("B's mirror still in sync with etcd killed")
		}
		return nil
	})

	// A get that does not wait: the node's Fetch, then the client's get.
	start := time.Now()
	err := b.node.Fetch(ctx, 0, 0, "remote", store.ClusterGet{})
	if !errors.Is(err, cluster.ErrUnavailable) {
		t.Fatalf("Fetch of a remote name with etcd down: %v, want ErrUnavailable", err)
	}
	t.Logf("Fetch with etcd down failed in %v: %v", time.Since(start).Round(time.Millisecond), err)
	start = time.Now()
	_, err = b.get(ctx, "remote")
	if !errors.Is(err, client.ErrUnavailable) {
		t.Fatalf("get of a remote name with etcd down: %v, want ErrUnavailable", err)
	}
	if took := time.Since(start); took > 15*time.Second {
		t.Fatalf("the get with etcd down took %v", took)
	}
	t.Logf("get with etcd down failed in %v: %v", time.Since(start).Round(time.Millisecond), err)

	// Local work goes on.
	if got, err := b.get(ctx, "kept"); err != nil || !bytes.Equal(got, kept) {
		t.Fatalf("local get with etcd down: %v", err)
	}
	local := b.put(t, "local", 7000, client.CreateOptions{})
	if got, err := b.get(ctx, "local"); err != nil || !bytes.Equal(got, local) {
		t.Fatalf("local put and get with etcd down: %v", err)
	}

	// A get that starts waiting now keeps waiting through the outage.
	res := make(chan error, 1)
	go func() {
		gctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		l, err := b.c.GetWith(gctx, "after", client.GetOptions{Wait: true})
		if err == nil {
			if !bytes.Equal(l.Bytes(), randomBytes(9000, 77)) {
				err = errors.New("B read other bytes than A's")
			}
			l.Release()
		}
		res <- err
	}()
	waitingGets(t, b, 1)
	time.Sleep(3 * time.Second) // longer than a directory call's fail-fast window
	select {
	case err := <-res:
		t.Fatalf("the waiting get answered during the outage: %v", err)
	default:
	}
	srv.Restart()
	clusterPutWorks(t, a)
	var created time.Time
	testutil.Eventually(t, 30*time.Second, func() error {
		o, err := a.c.Create(ctx, "after", 9000, client.CreateOptions{Cluster: true})
		if err != nil {
			return err
		}
		copy(o.Bytes(), randomBytes(9000, 77))
		created = time.Now()
		return o.Seal(ctx)
	})
	select {
	case err := <-res:
		if err != nil {
			t.Fatalf("the get waiting through the outage: %v", err)
		}
		t.Logf("the get waiting through the outage answered %v after A's create", time.Since(created).Round(time.Millisecond))
	case <-ctx.Done():
		t.Fatal("the get waiting through the outage never answered")
	}
	if got, err := b.get(ctx, "remote"); err != nil || !bytes.Equal(got, remote) {
		t.Fatalf("get of the remote name after etcd came back: %v", err)
	}
}
