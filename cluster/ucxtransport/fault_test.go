package ucxtransport_test

import (
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/clustertest"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// A reader killed (SIGKILL) mid-pull leaves nothing on the holder: its pin
// goes with its etcd lease, the exposure with its control connection, and
// it never became a holder (issue 19 item 5).
func TestReaderKilledMidPull(t *testing.T) {
	requireUCX(t)
	clustertest.RequireNet(t)
	etcdtest.Require(t)
	nw := clustertest.NewNet(t)
	etcd := nw.StartEtcd()
	spawn := func(name string) *testutil.Child {
		c := testutil.SpawnWith(t, "fanout-node", testutil.SpawnOptions{SysProcAttr: clustertest.NewNetnsAttr(),
			Env: []string{"UCX_TLS=tcp", "UCX_NET_DEVICES=eth0", "UCX_WARN_UNUSED_ENV_VARS=n", "UCX_LOG_FILE=stderr"}})
		ip := nw.Link(c.Pid(), "20mbit") // 16 MiB take ~7 s: time to kill the reader mid-pull
		if err := c.Send(nodeCmd{Op: "start", Node: name, IP: ip, Etcd: etcd, Streams: 2}); err != nil {
			t.Fatal(err)
		}
		recv(t, c, time.Minute)
		return c
	}
	pub, reader := spawn("pub"), spawn("reader")
	const name = "ns/victim"
	if err := pub.Send(nodeCmd{Op: "put", Name: name, Size: 16 << 20, Chunk: 128 << 10}); err != nil {
		t.Fatal(err)
	}
	recv(t, pub, time.Minute)
	// state asks the publisher what it pins, exposes and sees as holders. Its
	// holder list is an etcd read, which can miss its 2 s call timeout while
	// the tc-limited link is full: the waits below retry such an answer.
	state := func() (nodeReply, error) {
		t.Helper()
		if err := pub.Send(nodeCmd{Op: "state", Name: name}); err != nil {
			t.Fatal(err)
		}
		r := recvAny(t, pub, time.Minute)
		if r.Err != "" {
			return r, fmt.Errorf("publisher's state: %s", r.Err)
		}
		return r, nil
	}
	if err := reader.Send(nodeCmd{Op: "pull", Name: name}); err != nil {
		t.Fatal(err)
	}
	// Kill it once data flows (1 MiB sent by the publisher), not while its
	// UCX endpoint is being wired up: a reader dying then crashes the
	// holder in UCX 1.13.1 (an assertion in ucp_request_send_state_ff on a
	// pending wireup REP; docs/cluster.md, "Failure behaviour").
	base := nw.Sent(pub.Pid())
	testutil.Eventually(t, testutil.Wait, func() error {
		s, err := state()
		if err != nil {
			return err
		}
		if s.Pinned != 1 || s.Exposed != 1 {
			return fmt.Errorf("publisher: %d pins, %d exposures; want the reader's", s.Pinned, s.Exposed)
		}
		if sent := nw.Sent(pub.Pid()) - base; sent < 1<<20 {
			return fmt.Errorf("publisher sent %d bytes", sent)
		}
		return nil
	})
	if err := syscall.Kill(reader.Pid(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	// The reader's lease has a 2 s TTL (clustertest.OpenNode).
	testutil.Eventually(t, testutil.Wait, func() error {
		s, err := state()
		if err != nil {
			return err
		}
		if s.Pinned != 0 || s.Exposed != 0 || !slices.Equal(s.Holders, []string{"pub"}) {
			return fmt.Errorf("publisher after the reader's death: %d pins, %d exposures, holders %v", s.Pinned, s.Exposed, s.Holders)
		}
		return nil
	})
	t.Logf("pin and exposure gone %v after the kill", time.Since(killed).Round(10*time.Millisecond))
	pub.CloseStdin()
	if err := pub.Wait(30 * time.Second); err != nil {
		t.Errorf("publisher: %v\n%s", err, pub.Stderr())
	}
}

// A publisher killed after the first of a version's two shards leaves no
// version: latest never moves, and the shard it recorded has no live
// holder once its lease expires, so a reader gets "no live node holds the
// object" rather than a half version (issue 19 item 5). Another node
// publishing the second shard does not commit the version either; a live
// node publishing the first again does.
func TestPublisherKilledMidVersion(t *testing.T) {
	requireUCX(t)
	clustertest.RequireNet(t)
	etcdtest.Require(t)
	nw := clustertest.NewNet(t)
	etcd := nw.StartEtcd()
	var nodes []*testutil.Child
	for _, name := range []string{"pub", "reader"} {
		c := testutil.SpawnWith(t, "fanout-node", testutil.SpawnOptions{SysProcAttr: clustertest.NewNetnsAttr(),
			Env: []string{"UCX_TLS=tcp", "UCX_NET_DEVICES=eth0", "UCX_WARN_UNUSED_ENV_VARS=n", "UCX_LOG_FILE=stderr"}})
		if err := c.Send(nodeCmd{Op: "start", Node: name, IP: nw.Link(c.Pid(), ""), Etcd: etcd}); err != nil {
			t.Fatal(err)
		}
		recv(t, c, time.Minute)
		nodes = append(nodes, c)
	}
	pub, reader := nodes[0], nodes[1]
	const name = "ns/step"
	ask := func(c *testutil.Child, cmd nodeCmd) nodeReply {
		t.Helper()
		if err := c.Send(cmd); err != nil {
			t.Fatal(err)
		}
		return recvAny(t, c, time.Minute)
	}
	if r := ask(pub, nodeCmd{Op: "put", Name: name, Size: 1 << 20, Chunk: 256 << 10, Version: 1, Shard: 0, Shards: 2}); r.Err != "" {
		t.Fatal(r.Err)
	}
	if r := ask(reader, nodeCmd{Op: "state", Name: name, Version: 1, Shard: 0}); r.Err != "" || r.Latest != 0 || !slices.Equal(r.Holders, []string{"pub"}) {
		t.Fatalf("after shard 0 of 2: %+v, want no latest and pub holding the shard", r)
	}
	if err := syscall.Kill(pub.Pid(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// Its holder key goes with its lease (TTL 2 s).
	testutil.Eventually(t, testutil.Wait, func() error {
		if r := ask(reader, nodeCmd{Op: "state", Name: name, Version: 1, Shard: 0}); r.Err != "" || r.Latest != 0 || len(r.Holders) != 0 {
			return fmt.Errorf("after the publisher's death: %+v, want no latest and no holder", r)
		}
		return nil
	})
	r := ask(reader, nodeCmd{Op: "pull", Name: name, Version: 1, Shard: 0})
	if !strings.Contains(r.Err, cluster.ErrNoHolder.Error()) || !strings.Contains(r.Err, "holders in the directory: none") {
		t.Fatalf("pull of the dead publisher's shard: %q, want %q with no holders", r.Err, cluster.ErrNoHolder)
	}
	// The remaining shard, published by a live node, does not commit the
	// version: shard 0 is recorded but nobody can read it.
	if r := ask(reader, nodeCmd{Op: "put", Name: name, Size: 1 << 20, Chunk: 256 << 10, Version: 1, Shard: 1, Shards: 2}); r.Err != "" {
		t.Fatal(r.Err)
	}
	if r := ask(reader, nodeCmd{Op: "state", Name: name, Version: 1, Shard: 1}); r.Err != "" || r.Latest != 0 || !slices.Equal(r.Holders, []string{"reader"}) {
		t.Fatalf("after shard 1 of 2 with shard 0's publisher dead: %+v, want no latest and reader holding shard 1", r)
	}
	// A live node publishing shard 0 again completes the version.
	pub2 := testutil.SpawnWith(t, "fanout-node", testutil.SpawnOptions{SysProcAttr: clustertest.NewNetnsAttr(),
		Env: []string{"UCX_TLS=tcp", "UCX_NET_DEVICES=eth0", "UCX_WARN_UNUSED_ENV_VARS=n", "UCX_LOG_FILE=stderr"}})
	if err := pub2.Send(nodeCmd{Op: "start", Node: "pub2", IP: nw.Link(pub2.Pid(), ""), Etcd: etcd}); err != nil {
		t.Fatal(err)
	}
	recv(t, pub2, time.Minute)
	put := ask(pub2, nodeCmd{Op: "put", Name: name, Size: 1 << 20, Chunk: 256 << 10, Version: 1, Shard: 0, Shards: 2})
	if put.Err != "" {
		t.Fatal(put.Err)
	}
	if r := ask(reader, nodeCmd{Op: "state", Name: name, Version: 1, Shard: 0}); r.Err != "" || r.Latest != 1 || !slices.Equal(r.Holders, []string{"pub2"}) {
		t.Fatalf("after shard 0 again on pub2: %+v, want latest 1 and pub2 holding shard 0", r)
	}
	if r := ask(reader, nodeCmd{Op: "pull", Name: name, Version: 1, Shard: 0}); r.Err != "" || r.Sum != put.Sum {
		t.Fatalf("pull of shard 0 from pub2: sha256 %s %q, want %s", r.Sum, r.Err, put.Sum)
	}
	for _, c := range []*testutil.Child{reader, pub2} {
		c.CloseStdin()
		if err := c.Wait(30 * time.Second); err != nil {
			t.Errorf("helper %d: %v\n%s", c.Pid(), err, c.Stderr())
		}
	}
}
