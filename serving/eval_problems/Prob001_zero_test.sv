`timescale 1 ps/1 ps

// Stimulus generator: the design has no inputs, so this only lets a fixed
// number of clock edges pass (each edge is one compared sample) and then
// ends the simulation.
module stimulus_gen (
  input clk
);

  initial begin
    repeat (20) @(posedge clk, negedge clk);
    #1 $finish;
  end

endmodule

module tb ();

  reg clk = 0;
  initial forever #5 clk = ~clk;

  wire zero_ref;
  wire zero_dut;

  integer errors = 0;
  integer clocks = 0;
  integer errors_zero = 0;
  integer errortime_zero = 0;

  stimulus_gen stim1 (
    .clk(clk)
  );

  RefModule good1 (
    .zero(zero_ref)
  );

  TopModule top_module1 (
    .zero(zero_dut)
  );

  // Safety net against designs that hang the simulation.
  initial begin #1000000 $display("TIMEOUT"); $finish(); end

  // Bitwise match: a bit matches when it is identical (===) in both designs.
  // A bit that is x in the reference is treated as "don't care".
  wire match_zero = (zero_ref === (zero_ref ^ zero_dut ^ zero_ref));

  always @(posedge clk, negedge clk) begin
    clocks = clocks + 1;
    if (!match_zero) begin
      if (errors_zero == 0) errortime_zero = $time;
      errors_zero = errors_zero + 1;
    end
    if (!match_zero)
      errors = errors + 1;
  end

  // Runs on every $finish (normal end or timeout).
  final begin
    if (errors_zero)
      $display("Hint: Output '%s' has %1d mismatches. First mismatch occurred at time %1d.", "zero", errors_zero, errortime_zero);
    else
      $display("Hint: Output '%s' has no mismatches.", "zero");
    $display("Hint: Total mismatched samples is %1d out of %1d samples", errors, clocks);
    $display("Simulation finished at %1d ps", $time);
    $display("Mismatches: %1d in %1d samples", errors, clocks);
  end

endmodule
