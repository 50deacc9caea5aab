package cudaipc_test

import (
	"errors"
	"fmt"
	"log"

	"github.com/cudaipc/cudaipc"
)

// Export a buffer from one process. The handle's text form travels to the
// other process by any means (a socket, a file, an environment variable).
func ExampleBuffer_MemHandle() {
	dev, err := cudaipc.DeviceByOrdinal(0)
	if errors.Is(err, cudaipc.ErrNoDriver) {
		log.Fatal("this machine has no NVIDIA driver")
	} else if err != nil {
		log.Fatal(err)
	}
	buf, err := dev.Alloc(64 << 20)
	if err != nil {
		log.Fatal(err)
	}
	defer buf.Free() // only after every importer has closed its mapping
	h, err := buf.MemHandle()
	if err != nil {
		log.Fatal(err)
	}
	text, _ := h.MarshalText()
	fmt.Println(string(text))
}

// Map memory exported by another process, read it, and close the mapping.
func ExampleDevice_OpenMemHandle() {
	var h cudaipc.MemHandle
	if err := h.UnmarshalText([]byte("...base64 from the exporter...")); err != nil {
		log.Fatal(err)
	}
	dev, err := cudaipc.DeviceByOrdinal(0)
	if err != nil {
		log.Fatal(err)
	}
	p, err := dev.OpenMemHandle(h, cudaipc.LazyEnablePeerAccess)
	if errors.Is(err, cudaipc.ErrInvalidResourceHandle) {
		log.Fatal("the exporter freed the memory or exited")
	} else if err != nil {
		log.Fatal(err)
	}
	defer dev.CloseMemHandle(p)
	head := make([]byte, 4096)
	if err := dev.CopyFromDevice(head, p); err != nil {
		log.Fatal(err)
	}
}

// Order a consumer's reads after a producer's writes in another process.
func ExampleEvent_IPCHandle() {
	dev, err := cudaipc.DeviceByOrdinal(0)
	if err != nil {
		log.Fatal(err)
	}
	ev, err := dev.NewIPCEvent()
	if err != nil {
		log.Fatal(err)
	}
	defer ev.Close()
	stream, err := dev.NewStream()
	if err != nil {
		log.Fatal(err)
	}
	defer stream.Close()
	// ... queue writes on stream, then:
	if err := ev.Record(stream); err != nil {
		log.Fatal(err)
	}
	eh, _ := ev.IPCHandle() // the consumer: OpenEventHandle(eh), then its stream.WaitEvent(ev)
	_ = eh
}
