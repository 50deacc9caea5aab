package ucx_test

import (
	"context"
	"fmt"
	"io"
	"os"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/transport/ucx"
)

// A node serves an arena it registered once; a reader on another node (here
// the same process, for brevity) decodes what the node published, connects
// and reads part of the arena with one-sided GETs.
func Example() {
	// The serving node.
	sc, err := ucx.NewContext(ucx.ContextOptions{Name: "holder"})
	if err != nil {
		fmt.Println(err) // without libucp: "UCX not found: ... install libucx0 ..."
		return
	}
	defer sc.Close()
	sw, err := sc.NewWorker(ucx.WorkerOptions{})
	if err != nil {
		fmt.Println(err)
		return
	}
	arena := make([]byte, 1<<20) // a daemon registers its mmap'd arena
	copy(arena[4096:], "hello from the holder")
	region, err := sc.Register(arena)
	if err != nil {
		fmt.Println(err)
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go sw.Serve(ctx)
	addrBytes, _ := sw.Address().MarshalBinary() // published, e.g. in etcd
	keyBytes, _ := region.Key().MarshalBinary()

	// The reading node.
	rc, err := ucx.NewContext(ucx.ContextOptions{Name: "reader"})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer rc.Close()
	rw, err := rc.NewWorker(ucx.WorkerOptions{})
	if err != nil {
		fmt.Println(err)
		return
	}
	var addr ucx.WorkerAddress
	var key ucx.RegionKey
	if err := addr.UnmarshalBinary(addrBytes); err != nil {
		fmt.Println(err)
		return
	}
	if err := key.UnmarshalBinary(keyBytes); err != nil {
		fmt.Println(err)
		return
	}
	ep, err := rw.Connect(addr)
	if err != nil {
		fmt.Println(err)
		return
	}
	rkey, err := ep.Unpack(key)
	if err != nil {
		fmt.Println(err)
		return
	}
	dst := make([]byte, 21)
	getCtx, done := context.WithTimeout(context.Background(), 10*time.Second)
	defer done()
	if err := ucx.Get(getCtx, ep, rkey, key.Addr+4096, dst); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(string(dst))
}

// TestExample runs Example where UCX is present (an Example without an
// Output comment is only compiled) and checks what it prints.
func TestExample(t *testing.T) {
	requireUCX(t)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = w
	Example()
	os.Stdout = stdout
	w.Close()
	out, _ := io.ReadAll(r)
	if string(out) != "hello from the holder\n" {
		t.Fatalf("Example printed %q", out)
	}
}
