package client_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/cudaipc/cudaipc/client"
)

// A producer creates an object, fills it in place and seals it; from then
// on any process of an admitted user can lease it by name.
func Example() {
	ctx := context.Background()
	c, err := client.Dial(ctx, "") // $CUDAIPC_SOCKET or the per-user default
	if err != nil {
		log.Fatal(err) // e.g. no daemon: start one with 'cudaipc serve'
	}
	defer c.Close()

	obj, err := c.Create(ctx, "weights", 1<<20, client.CreateOptions{})
	if err != nil {
		log.Fatal(err)
	}
	copy(obj.Bytes(), "written in place, no copy through the socket")
	if err := obj.Seal(ctx); err != nil {
		log.Fatal(err)
	}

	lease, err := c.Get(ctx, "weights")
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release()
	fmt.Printf("%s\n", lease.Bytes()[:7])
}

// Get takes an object already sealed (ErrNotFound otherwise); with
// GetOptions.Wait it waits until the object is sealed, and a context
// deadline bounds the wait.
func ExampleClient_GetWith() {
	c, err := client.Dial(context.Background(), "")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	lease, err := c.GetWith(ctx, "frame-0042", client.GetOptions{Wait: true})
	switch {
	case errors.Is(err, client.ErrTimeout):
		log.Fatal("frame-0042 was not produced within 5s")
	case errors.Is(err, client.ErrStoreGone):
		log.Fatal("the store daemon stopped; dial again once it is back")
	case err != nil:
		log.Fatal(err)
	}
	defer lease.Release()
	fmt.Println(len(lease.Bytes()), "bytes, read-only, mapped in place")
}

// Subscribe reports seals, deletions, evictions and aborts as they happen.
func ExampleClient_Subscribe() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c, err := client.Dial(ctx, "")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	events, err := c.Subscribe(ctx)
	if err != nil {
		log.Fatal(err)
	}
	for ev := range events {
		if ev.Kind == client.EventSealed {
			fmt.Println("ready:", ev.Name)
		}
	}
}

// Objects on a GPU: the producer writes through WriteAt (or kernels at
// Ptr), the consumer gets a mapping of the daemon's GPU memory in its own
// process (one cuIpcOpenMemHandle per arena, then none) and reads through
// ReadAt, or uses Ptr with its own kernels. Device "0" is this process's
// GPU 0; the client sends its UUID.
func ExampleObject_WriteAt() {
	ctx := context.Background()
	c, err := client.Dial(ctx, "")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	obj, err := c.Create(ctx, "activations/step-1", 64<<20, client.CreateOptions{Device: "0"})
	if err != nil {
		log.Fatal(err) // e.g. INVALID when the daemon runs --backend host
	}
	if _, err := obj.WriteAt(make([]byte, 4096), 0); err != nil {
		log.Fatal(err)
	}
	if err := obj.Seal(ctx); err != nil {
		log.Fatal(err)
	}

	lease, err := c.Get(ctx, "activations/step-1")
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release()
	fmt.Println(lease.Device(), lease.Ptr() != 0) // GPU-… true
	head := make([]byte, 4096)
	if _, err := lease.ReadAt(head, 0); err != nil {
		log.Fatal(err)
	}
}
